"""Engines whose KV-event block hashes the gateway can reproduce, by engine kind.

With a hasher for an endpoint's engine kind, the precise index matches requests against the
engine's own hashes (exact, salt included); without one it uses keys re-derived from the events'
token ids (see `precise.py`). vLLM's default sha256 over pickled tuples, seeded by `PYTHONHASHSEED`,
is deliberately not reproduced: token keys cover it without coupling to its version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from xxhash import xxh3_64_intdigest

# (token ids as uint32 little-endian bytes, block_size, cache_salt) -> the engine's 64-bit hashes of the
# leading full blocks. Bytes, because the request's ids are converted once and shared by every index.
EngineHasher = Callable[[bytes, int, str | None], list[int]]


def sim_hashes(data: bytes, block_size: int, cache_salt: str | None) -> list[int]:
    """`backends.sim.kv_cache.hash_blocks` restated over one bytes buffer (a test pins it to the
    engine's function): xxh3_64(parent as 8 LE bytes ++ the block's uint32 ids [++ salt on block 0])."""
    from backends.sim.kv_cache import NONE_HASH

    step = block_size * 4
    salt = b"\x00salt\x00" + cache_salt.encode() if cache_salt else b""
    keys: list[int] = []
    append = keys.append
    parent = NONE_HASH
    view = memoryview(data)
    for offset in range(0, len(data) - step + 1, step):
        chunk = parent.to_bytes(8, "little") + view[offset : offset + step]
        if offset == 0 and salt:
            chunk += salt
        parent = xxh3_64_intdigest(chunk)
        append(parent)
    return keys


ENGINE_HASHERS: Mapping[str, EngineHasher] = MappingProxyType({"sim": sim_hashes})

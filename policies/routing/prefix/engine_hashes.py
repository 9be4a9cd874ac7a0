"""Engines whose KV-event block hashes the gateway can reproduce, by engine kind.

With a hasher for an endpoint's engine kind, the precise index matches requests against the
engine's own hashes (exact, salt included); without one it uses keys re-derived from the events'
token ids (see `precise.py`). vLLM's default sha256 over pickled tuples, seeded by `PYTHONHASHSEED`,
is deliberately not reproduced: token keys cover it without coupling to its version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from backends.block_hash import hash_token_bytes

# (token ids as uint32 little-endian bytes, block_size, cache_salt) -> the engine's 64-bit hashes of the
# leading full blocks. Bytes, because the request's ids are converted once and shared by every index.
EngineHasher = Callable[[bytes, int, str | None], list[int]]


# the simulated engine: `backends/block_hash.py` (a test pins the bytes form to the engine's own)
ENGINE_HASHERS: Mapping[str, EngineHasher] = MappingProxyType({"sim": hash_token_bytes})

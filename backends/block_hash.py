"""The simulated engine's KV block hashes, shared by the engine and the router that reproduces them.

xxh3_64 over (parent hash as 8 little-endian bytes ++ the block's token ids as uint32), the first
parent being ``xxh3_64(b"tokenway-sim-none-hash")``; a request's ``cache_salt`` is mixed into block 0
only (vLLM's extra_keys). The 64-bit ints are what the engine's KV events publish, so a precise
prefix index that hashes a request the same way matches the engine's own blocks, salt included.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Final

import xxhash

NONE_HASH: Final = xxhash.xxh3_64_intdigest(b"tokenway-sim-none-hash")
_SALT_TAG: Final = b"\x00salt\x00"


def lora_salt(cache_salt: str | None, lora_name: str | None) -> str | None:
    """The block-0 salt of a request: its `cache_salt`, with its LoRA adapter's name mixed in (vLLM
    adds the adapter to every block's extra keys; in a chained hash, salting block 0 separates every
    block after it alike), so two adapters never share a cached block."""
    if not lora_name:
        return cache_salt
    return f"{cache_salt or ''}\x00lora\x00{lora_name}"


def hash_block(parent: int, token_ids: Sequence[int], salt: str | None = None) -> int:
    """The chained 64-bit hash of one full block."""
    data = parent.to_bytes(8, "little") + array("I", token_ids).tobytes()
    if salt:
        data += _SALT_TAG + salt.encode()
    return xxhash.xxh3_64_intdigest(data)


def hash_blocks(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """Hashes of every full block of `token_ids` (what a router can recompute from the events)."""
    hashes: list[int] = []
    num_blocks = len(token_ids) // block_size
    chain_hashes(hashes, NONE_HASH, token_ids[: num_blocks * block_size], block_size, salt)
    return hashes


def chain_hashes(out: list[int], parent: int, token_ids: Sequence[int], block_size: int, salt: str | None) -> None:
    """Append the chained hashes of the full blocks of `token_ids` (`salt`: mixed into the first
    one, which is block 0 of the request) to `out`; `hash_block`'s bytes, built from one buffer."""
    data = array("I", token_ids).tobytes()
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    start = 0
    if salt and len(data) >= step:
        parent = hash_block(parent, token_ids[:block_size], salt)
        out.append(parent)
        start = step
    for offset in range(start, len(data) - step + 1, step):
        parent = digest(parent.to_bytes(8, "little") + data[offset : offset + step])
        out.append(parent)


def hash_token_bytes(data: bytes, block_size: int, cache_salt: str | None) -> list[int]:
    """`hash_blocks` over token ids already packed as uint32 little-endian bytes (the router packs a
    request's ids once and shares the buffer between its indexes)."""
    step = block_size * 4
    salt = _SALT_TAG + cache_salt.encode() if cache_salt else b""
    keys: list[int] = []
    append = keys.append
    parent = NONE_HASH
    view = memoryview(data)
    digest = xxhash.xxh3_64_intdigest
    for offset in range(0, len(data) - step + 1, step):
        chunk = parent.to_bytes(8, "little") + view[offset : offset + step]
        if offset == 0 and salt:
            chunk += salt
        parent = digest(chunk)
        append(parent)
    return keys

"""Builders of KV-event batches as an engine would publish them (sim hashes as the engine's hashes)."""

from __future__ import annotations

from backends.block_hash import hash_blocks
from backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch


def engine_hashes(ids: list[int], block: int = 16, salt: str | None = None) -> list[int]:
    return hash_blocks(ids, block, salt)


def stored(
    ids: list[int],
    *,
    first_block: int = 0,
    block: int = 16,
    salt: str | None = None,
    medium: str | None = "GPU",
    publish_salt: bool = False,
) -> BlockStored:
    """BlockStored for blocks [first_block, full blocks) of `ids`, chained to block first_block-1."""
    hashes = engine_hashes(ids, block, salt)
    parent = hashes[first_block - 1] if first_block else None
    extra = [(salt,)] + [None] * (len(hashes) - first_block - 1) if publish_salt and salt and not first_block else None
    return BlockStored(
        block_hashes=hashes[first_block:],
        parent_block_hash=parent,
        token_ids=ids[first_block * block : len(hashes) * block],
        block_size=block,
        medium=medium,
        extra_keys=extra,
    )


def removed(ids: list[int], blocks: list[int], *, block: int = 16, medium: str | None = "GPU") -> BlockRemoved:
    hashes = engine_hashes(ids, block)
    return BlockRemoved(block_hashes=[hashes[i] for i in blocks], medium=medium)


def batch(*events: KvEvent, seq: int = 0, at_s: float = 1000.0) -> KvEventBatch:
    return KvEventBatch(seq=seq, ts=0.0, events=list(events), received_at_s=at_s)


def cleared() -> AllBlocksCleared:
    return AllBlocksCleared()

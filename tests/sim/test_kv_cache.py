from __future__ import annotations

from backends.block_hash import NONE_HASH, hash_block, hash_blocks
from sim.kv_cache import KVCacheManager
from sim.scheduler import Request


def make_request(prompt: list[int], salt: str | None = None) -> Request:
    return Request("r", prompt, [7] * 8, "length", 0.0, 8, cache_salt=salt)


def test_hashes_chain_over_full_blocks_only() -> None:
    tokens = list(range(40))
    hashes = hash_blocks(tokens, 16)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(NONE_HASH, tokens[:16])
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])


def test_cache_salt_changes_every_hash_through_the_chain() -> None:
    tokens = list(range(48))
    assert all(a != b for a, b in zip(hash_blocks(tokens, 16), hash_blocks(tokens, 16, "tenant-a"), strict=True))


def test_second_request_reuses_the_first_ones_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request(list(range(10)))
    assert kv.allocate_slots(first, 10)
    kv.free(first)
    second = make_request([*range(10), 99])
    hits = kv.computed_blocks(second)
    assert len(hits) == 2  # tokens 0..7 in two full blocks; block 3 was partial
    stored = [e for e in kv.pool.drain_events() if e.kind == "stored"]
    assert stored[0].block_hashes == tuple(hash_blocks(list(range(10)), 4))
    assert stored[0].token_ids == tuple(range(8))


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request(list(range(8)))
    assert kv.allocate_slots(first, 8)
    kv.free(first)
    assert len(kv.computed_blocks(make_request(list(range(8))))) == 1


def test_freed_blocks_stay_cached_until_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    old = make_request(list(range(8)))
    kv.allocate_slots(old, 8)
    kv.free(old)
    assert kv.usage == 0.0  # evictable cached blocks count as free
    kv.pool.drain_events()
    new = make_request(list(range(100, 112)))
    assert kv.allocate_slots(new, 12)
    removed = [e for e in kv.pool.drain_events() if e.kind == "removed"]
    assert len(removed) == 1  # one of the two cached blocks had to go
    assert kv.usage == 0.75
    assert not kv.allocate_slots(make_request(list(range(200, 208))), 8)


def test_reset_clears_hashes_only_when_idle() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request(list(range(8)))
    kv.allocate_slots(req, 8)
    assert not kv.reset_prefix_cache()
    kv.free(req)
    assert kv.reset_prefix_cache()
    assert [e.kind for e in kv.pool.drain_events()][-1] == "cleared"
    assert kv.computed_blocks(make_request(list(range(9)))) == []

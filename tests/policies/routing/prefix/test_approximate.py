import gc
import tracemalloc

import pytest

from policies.routing.prefix_index import ApproximatePrefixIndex
from tests.policies.routing.factories import endpoint, prompt, token_ids


def test_records_and_matches_shared_prefix() -> None:
    index = ApproximatePrefixIndex(block_tokens=64)
    a, b = endpoint("a"), endpoint("b")
    index.record(prompt(token_ids(1000)), a)
    follow_up = prompt(token_ids(640) + token_ids(300, start=3))
    assert index.lookup(follow_up, [a, b]) == [640, 0]


@pytest.mark.parametrize(
    ("salt", "model", "hit"),
    [
        pytest.param(None, "m", True, id="same-namespace"),
        pytest.param("tenant-b", "m", False, id="other-cache-salt"),
        pytest.param(None, "other-model", False, id="other-model"),
    ],
)
def test_namespaces(salt: str | None, model: str, hit: bool) -> None:
    index = ApproximatePrefixIndex(block_tokens=64)
    a = endpoint("a")
    index.record(prompt(token_ids(1000)), a)
    cached = index.lookup(prompt(token_ids(1000), cache_salt=salt, model=model), [a])[0]
    assert (cached > 0) is hit


@pytest.mark.parametrize(
    ("num_gpu_blocks", "block_size", "expected_capacity"),
    [
        pytest.param(100, 16, 25, id="from-engine-kv-size"),
        pytest.param(None, None, 7812, id="default-capacity"),
        pytest.param(10**9, 16, 62_500, id="capped"),
    ],
)
def test_capacity_from_engine_stats(num_gpu_blocks: int | None, block_size: int | None, expected_capacity: int) -> None:
    index = ApproximatePrefixIndex(block_tokens=64, default_capacity_tokens=500_000, max_capacity_tokens=4_000_000)
    e = endpoint("a", num_gpu_blocks=num_gpu_blocks, block_size=block_size)
    index.record(prompt(token_ids(128)), e)
    assert index.stats()["a"].capacity_blocks == expected_capacity


def test_lru_evicts_tail_first_and_oldest_prompt_first() -> None:
    index = ApproximatePrefixIndex(block_tokens=64)
    e = endpoint("a", num_gpu_blocks=32, block_size=16)  # 512 tokens = 8 blocks
    old, new = token_ids(384, start=1), token_ids(384, start=2)  # 6 blocks each
    index.record(prompt(old), e)
    index.record(prompt(new), e)
    assert index.lookup(prompt(new), [e]) == [383]
    assert index.lookup(prompt(old), [e]) == [128]  # its head (2 blocks) survived, its tail went first


@pytest.mark.slow
def test_memory_stays_bounded_under_unique_prompts() -> None:
    index = ApproximatePrefixIndex(block_tokens=64, default_capacity_tokens=64 * 200)
    eps = [endpoint(f"e{i}", block_size=None) for i in range(4)]
    prompts = [token_ids(64 * 10, start=i + 1) for i in range(1000)]
    gc.collect()
    tracemalloc.start()
    try:
        for i, ids in enumerate(prompts):
            index.record(prompt(ids), eps[i % 4])
            if i == 499:
                gc.collect()
                half_way = tracemalloc.get_traced_memory()[0]
        gc.collect()
        at_end = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert all(s.entries == 200 for s in index.stats().values())
    assert index.memory_bytes() <= index.max_memory_bytes(4)
    assert at_end - half_way < 0.1 * half_way  # plateau: the second 500 prompts added ~nothing
    assert index.evictions == 1000 * 10 - 4 * 200


def test_forget_and_retain() -> None:
    index = ApproximatePrefixIndex(block_tokens=64)
    a, b = endpoint("a"), endpoint("b")
    f = prompt(token_ids(640))
    index.record(f, a)
    index.record(f, b)
    index.retain(["b"])
    assert index.lookup(f, [a, b]) == [0, 639]
    index.forget("b")
    assert index.entries() == 0 and index.lookup(f, [a, b]) == [0, 0]

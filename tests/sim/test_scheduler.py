from __future__ import annotations

from sim.kv_cache import KVCacheManager
from sim.scheduler import Request, Scheduler, Status


def make(rid: str, prompt_len: int, output_len: int, base: int = 0) -> Request:
    return Request(rid, list(range(base, base + prompt_len)), [1] * output_len, "length", 0.0, output_len)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    now = 0.0
    while scheduler.has_work() and steps < max_steps:
        step = scheduler.schedule(now)
        now += 0.01
        scheduler.complete_step(step, now)
        steps += 1
    return steps


def test_chunked_prefill_respects_the_token_budget() -> None:
    scheduler = Scheduler(KVCacheManager(1000, 16), max_num_seqs=8, max_num_batched_tokens=256)
    scheduler.add(make("a", 1000, 4))
    step = scheduler.schedule(0.0)
    assert [(n, ctx) for _, n, ctx in step.prefills] == [(256, 0)]
    scheduler.complete_step(step, 0.01)
    step = scheduler.schedule(0.01)
    assert [(n, ctx) for _, n, ctx in step.prefills] == [(256, 256)]


def test_running_requests_decode_before_new_ones_are_admitted() -> None:
    scheduler = Scheduler(KVCacheManager(1000, 16), max_num_seqs=8, max_num_batched_tokens=64)
    scheduler.add(make("a", 10, 5))
    scheduler.complete_step(scheduler.schedule(0.0), 0.01)
    scheduler.add(make("b", 200, 5, base=1000))
    step = scheduler.schedule(0.01)
    assert [r.request_id for r, _ in step.decodes] == ["a"]
    assert [(r.request_id, n) for r, n, _ in step.prefills] == [("b", 63)]


def test_max_num_seqs_caps_the_batch() -> None:
    scheduler = Scheduler(KVCacheManager(1000, 16), max_num_seqs=2, max_num_batched_tokens=4096)
    for i in range(4):
        scheduler.add(make(str(i), 20, 3, base=100 * i))
    scheduler.schedule(0.0)
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2


def test_exhausted_blocks_preempt_the_newest_request_which_later_finishes() -> None:
    scheduler = Scheduler(KVCacheManager(12, 4), max_num_seqs=8, max_num_batched_tokens=4096)
    requests = [make(str(i), 8, 12, base=100 * i) for i in range(3)]
    for req in requests:
        scheduler.add(req)
    steps = run_to_completion(scheduler)
    stats = scheduler.drain_stats()
    assert stats.preemptions > 0
    assert requests[-1].num_preemptions > 0 and requests[0].num_preemptions == 0
    assert all(r.status is Status.FINISHED and r.num_output == 12 for r in requests)
    assert steps < 10_000
    assert scheduler.kv.pool.num_free == 12


def test_first_token_arrives_when_the_prompt_is_fully_computed() -> None:
    scheduler = Scheduler(KVCacheManager(1000, 16), max_num_seqs=8, max_num_batched_tokens=100)
    req = make("a", 250, 2)
    scheduler.add(req)
    for expected_output in (0, 0, 1):
        scheduler.complete_step(scheduler.schedule(0.0), 0.0)
        assert req.num_output == expected_output

"""bench.replay's round-aware report: the best-peer target, the per-round table, the no-queue floor."""

import dataclasses

from bench.replay.report import rounds_table, target_check
from bench.replay.stats import RunSummary, ttft_floors
from bench.replay.workload import BLOCK_TOKENS, TraceRequest, best_case_cached_tokens

BASE = RunSummary(
    trace="t", load=0.8, router="x", offered_rps=1.0, requests=10, ok=10, ttft_p50_s=0.1, ttft_p90_s=1.0,
    ttft_p99_s=2.0, client_ttft_p50_s=0.1, client_ttft_p90_s=1.0, client_ttft_p99_s=2.0, tpot_p50_ms=10.0,
    tpot_p90_ms=20.0, client_tpot_p50_ms=10.0, client_tpot_p90_ms=20.0, throughput_rps=1.0, output_tps=10.0,
    cache_hit_rate=0.5, ttft_good_share=1.0, client_ttft_good_share=1.0, max_client_lag_s=0.0, host_cpu_busy=0.5,
    per_engine=[5, 5],
)  # fmt: skip


def run(router: str, seed: int, p90: float, hit: float = 0.5) -> RunSummary:
    return dataclasses.replace(BASE, router=router, seed=seed, ttft_p90_s=p90, cache_hit_rate=hit)


def test_target_uses_the_peer_with_the_lowest_mean_p90_and_pairs_rounds() -> None:
    runs = [
        run("llm-d-sticky", 1, 2.0, 0.6), run("llm-d-sticky", 2, 1.0, 0.6),
        run("vllm-router-cache", 1, 4.0), run("vllm-router-cache", 2, 4.0),
        run("round-robin", 1, 6.0), run("round-robin", 2, 6.0),
        run("tokenway-approx", 1, 1.0, 0.6), run("tokenway-approx", 2, 0.8, 0.6),
        run("tokenway-precise", 1, 1.4, 0.5), run("tokenway-precise", 2, 1.0, 0.5),
    ]  # fmt: skip
    lines = target_check(runs, "t")
    assert "best peer `llm-d-sticky`" in lines[0]
    approx = next(line for line in lines if line.startswith("| tokenway-approx"))
    assert "| 0.60 |" in approx and "0.50, 0.80" in approx  # 0.9 / 1.5 over the means; per round 1/2, 0.8/1
    assert "met: p90 ≤ 0.7x best peer; met: hit ≥ best peer's" in approx
    precise = next(line for line in lines if line.startswith("| tokenway-precise"))
    assert "MISSED: p90 ≤ 0.7x best peer; MISSED: hit ≥ best peer's" in precise


def test_no_peer_no_verdict() -> None:
    assert "not evaluated" in target_check([run("tokenway-approx", 1, 1.0)], "t")[0]


def test_rounds_table_spread() -> None:
    row = rounds_table([run("a", 1, 1.0), run("a", 2, 3.0)], "t", 0.8)[2]
    assert row.startswith("| a | 1.00 | 3.00 | 2.00 | 100.0 % |")


def test_best_case_cache_counts_leading_blocks_seen_before() -> None:
    reqs = [
        TraceRequest(0, 0.0, 2 * BLOCK_TOKENS, 1, (1, 2)),
        TraceRequest(1, 1.0, 3 * BLOCK_TOKENS, 1, (1, 2, 3)),
        TraceRequest(2, 2.0, 2 * BLOCK_TOKENS, 1, (9, 2)),  # block 2 after another first block: not a prefix
    ]
    assert best_case_cached_tokens(reqs) == [(1024, 0), (1536, 1024), (1024, 0)]


def test_floor_grows_with_uncached_tokens() -> None:
    cold, warm, long = ttft_floors([(8192, 0), (8192, 8000), (40_000, 0)], "llama-3.1-8b@h100")
    assert warm < cold < long

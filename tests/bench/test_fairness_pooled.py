"""The fairness benchmark's pooled reading: the days' phase-1 requests of B form one sample per side,
and each day keeps its own ratio beside the pooled one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench.fairness.pooled import phase1_engine_clock, phase1_ttfts, ratio_interval, render

PHASE_S = 10.0


def row(tenant: str, sent_s: float, ttft_s: float) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "status": 200,
        "code": None,
        "ttft_s": ttft_s,
        "e2e_s": ttft_s + 0.5,
        "sent_s": sent_s,
        "queued_ms": 0.0,
        "prompt_tokens": 100,
        "cached_tokens": 0,
        "completion_tokens": 10,
        "offered_tokens": 110,
        "flow": "",
    }


def day(seed: int, solo: list[float], flooded: list[float]) -> dict[str, Any]:
    def run(ttfts: list[float], phase2: bool) -> dict[str, Any]:
        rows = [row("B", i * PHASE_S / len(ttfts), t) for i, t in enumerate(ttfts)]
        rows += [row("A", i * 0.5, 0.2) for i in range(40)] if phase2 else []
        rows += [row("B", PHASE_S + 1.0, 9.0)] if phase2 else []  # phase 2: not B's usual rate
        return {"outcomes": rows}

    return {
        "args": {"seed": seed, "time_scale": 0.25, "phase_s": PHASE_S, "window_s": 5.0},
        "tenants": [
            {"name": "A", "priority": "normal", "weight": 1.0},
            {"name": "B", "priority": "normal", "weight": 2.0},
        ],
        "runs": {"solo-B": run(solo, False), "flow-reserve-preempt": run(flooded, True)},
    }


def test_phase_one_only_and_served_only() -> None:
    raw = day(7, [0.1, 0.2], [0.1, 0.3])
    assert phase1_ttfts(raw["runs"]["flow-reserve-preempt"], PHASE_S) == [0.1, 0.3]
    raw["runs"]["solo-B"]["outcomes"][0]["status"] = 429
    assert phase1_ttfts(raw["runs"]["solo-B"], PHASE_S) == [0.2]


@pytest.mark.slow
def test_the_pooled_ratio_is_of_both_days_together() -> None:
    solo7, flood7 = [0.10] * 49 + [0.30], [0.11] * 50
    solo8, flood8 = [0.10] * 50, [0.11] * 49 + [0.40]
    text = render([day(7, solo7, flood7), day(8, solo8, flood8)], ["a-raw.json", "b-raw.json"])
    pooled_ratio = np.percentile(flood7 + flood8, 99) / np.percentile(solo7 + solo8, 99)
    assert f"| {pooled_ratio:.2f}x |" in text
    # each day's own ratio stays visible: day 8 misses on its own
    day8 = np.percentile(flood8, 99) / np.percentile(solo8, 99)
    assert "| 8 | flow control + reserve + preemption | 100 ms |" in text
    assert f"{day8:.2f}x" in text
    assert "| flow control + reserve + preemption | 2 | 100 / 100 |" in text


@pytest.mark.slow
def test_the_interval_holds_the_point_estimate() -> None:
    rng = np.random.default_rng(3)
    solo = list(rng.gamma(9.0, 0.01, 300))
    flooded = list(rng.gamma(9.0, 0.012, 300))
    low, high = ratio_interval(flooded, solo)
    point = np.percentile(flooded, 99) / np.percentile(solo, 99)
    assert low <= point <= high
    assert low < high


@pytest.mark.slow
def test_the_engine_clock_adds_the_queue_and_leaves_the_lag_out() -> None:
    raw = day(7, [0.2] * 50, [0.3] * 50)
    for run in raw["runs"].values():
        for r in run["outcomes"]:
            r["engine_ttft_s"] = 0.025  # engine seconds: 0.1 wall s at time scale 0.25
    flooded = raw["runs"]["flow-reserve-preempt"]
    for r in flooded["outcomes"][:5]:
        r["queued_ms"] = 100.0
    pairs = phase1_engine_clock(flooded, PHASE_S, 0.25)
    assert len(pairs) == 50  # phase 2's request left out
    assert pairs[0][0] == pytest.approx(0.2) and pairs[-1][0] == pytest.approx(0.1)
    assert {wall for _, wall in pairs} == {0.3}
    text = render([raw], ["a-raw.json"])
    engine = [0.2] * 5 + [0.1] * 45
    p99 = np.percentile(engine, 99)
    # solo: 100 ms on the engine's clock and 100 ms of lag; flooded: 5 of 50 waited 100 ms in the queue
    assert f"| 100 / 100 ms | 100 / {p99 * 1000:.0f} ms | {p99 / 0.1:.2f}x |" in text
    assert "| 100 / 100 ms | 200 / 200 ms |" in text  # the lag columns: the queue is not lag


@pytest.mark.slow
def test_days_without_engine_timings_leave_the_engine_table_empty() -> None:
    text = render([day(7, [0.1] * 10, [0.1] * 10)], ["a-raw.json"])
    table = text.split("## Pooled on the engine's clock")[1].split("The interval")[0]
    assert "flow control + reserve + preemption" not in table

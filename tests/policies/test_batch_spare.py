"""Spare capacity for batch work: per endpoint (load, batch cap, prediction) and per pool (free slots)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backends.types import Endpoint, EndpointState, EndpointStats
from policies.batch import (
    REASON_BATCH_CAP,
    REASON_BATCH_PREFILLING,
    REASON_ENGINE_QUEUE,
    REASON_INFLIGHT,
    REASON_INTERACTIVE_WAITING,
    REASON_KV_USAGE,
    REASON_NOT_READY,
    REASON_PREDICTED_TPOT,
    REASON_PREDICTED_TTFT,
    LinePrediction,
    Objectives,
    SpareLimits,
    endpoint_spare,
    pool_spare_slots,
    tightest,
)

NOW = 1000.0
LIMITS = SpareLimits(max_lines_per_endpoint=4, max_engine_waiting=0, max_kv_usage_ratio=0.6, max_endpoint_inflight=10)


def endpoint(
    name: str = "e0",
    *,
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.1,
    inflight: int = 0,
    age_s: float | None = 0.1,
    state: EndpointState = EndpointState.READY,
) -> Endpoint:
    scraped_at_s = NOW - age_s if age_s else 0.0
    stats = EndpointStats(running=running, waiting=waiting, kv_usage_ratio=kv, scraped_at_s=scraped_at_s)
    e = Endpoint(
        id=f"p/{name}", pool="p", base_url="http://x", engine="sim", served_model="m", state=state, stats=stats
    )
    e.inflight.requests = inflight
    return e


@pytest.mark.parametrize(
    ("e", "batch_lines", "waiting", "expected"),
    [
        pytest.param(endpoint(), 0, 0, None, id="idle"),
        pytest.param(endpoint(), 0, 1, REASON_INTERACTIVE_WAITING, id="interactive-waiting"),
        pytest.param(endpoint(state=EndpointState.DRAINING), 0, 0, REASON_NOT_READY, id="draining"),
        pytest.param(endpoint(), 4, 0, REASON_BATCH_CAP, id="batch-cap"),
        pytest.param(endpoint(), 3, 0, None, id="under-batch-cap"),
        pytest.param(endpoint(waiting=1), 0, 0, REASON_ENGINE_QUEUE, id="engine-queue"),
        pytest.param(endpoint(waiting=1, age_s=5.0), 0, 0, None, id="stale-queue-not-read"),
        pytest.param(endpoint(kv=0.7), 0, 0, REASON_KV_USAGE, id="kv-full"),
        pytest.param(endpoint(inflight=10), 0, 0, REASON_INFLIGHT, id="inflight-cap"),
    ],
)
def test_endpoint_load(e: Endpoint, batch_lines: int, waiting: int, expected: str | None) -> None:
    assert endpoint_spare(e, LIMITS, NOW, batch_lines, interactive_waiting=waiting) == expected


@pytest.mark.parametrize(
    ("predicted", "objectives", "expected"),
    [
        pytest.param(None, Objectives(1000, 50), None, id="no-prediction"),
        pytest.param(LinePrediction(400, 20), Objectives(1000, 50), None, id="within-headroom"),
        pytest.param(LinePrediction(600, 20), Objectives(1000, 50), REASON_PREDICTED_TTFT, id="ttft-over-half"),
        pytest.param(LinePrediction(400, 30), Objectives(1000, 50), REASON_PREDICTED_TPOT, id="tpot-over-half"),
        pytest.param(LinePrediction(9000, 900), Objectives(), None, id="no-objectives"),
    ],
)
def test_endpoint_prediction(predicted: LinePrediction | None, objectives: Objectives, expected: str | None) -> None:
    busy = endpoint(inflight=1)
    assert endpoint_spare(busy, LIMITS, NOW, 0, predicted=predicted, objectives=objectives) == expected


@pytest.mark.parametrize(
    ("e", "expected"),
    [
        pytest.param(endpoint(), None, id="idle: the line's own latency harms nobody"),
        pytest.param(endpoint(inflight=1), REASON_PREDICTED_TTFT, id="a request in flight"),
        pytest.param(endpoint(running=1), REASON_PREDICTED_TTFT, id="the engine runs one (another gateway's)"),
        pytest.param(endpoint(running=1, age_s=5.0), None, id="a stale scrape is not read"),
    ],
)
def test_a_long_line_is_not_refused_on_an_idle_endpoint(e: Endpoint, expected: str | None) -> None:
    """A line whose prompt alone predicts a TTFT over the headroom runs where nothing else does;
    refused everywhere, a batch of long prompts never finished, even on an idle fleet."""
    long_line = LinePrediction(900, 20)
    assert endpoint_spare(e, LIMITS, NOW, 0, predicted=long_line, objectives=Objectives(1000, 50)) == expected


def test_pool_slots_count_free_batch_slots_of_endpoints_with_room() -> None:
    endpoints = [endpoint("a"), endpoint("b", waiting=2), endpoint("c")]
    running = {"p/a": 1, "p/c": 4}
    unpaced = replace(LIMITS, paced_starts=False)
    assert pool_spare_slots(endpoints, unpaced, NOW, running) == 3  # a: 4 - 1; b queues; c is at its cap
    assert pool_spare_slots(endpoints, unpaced, NOW, running, interactive_waiting=1) == 0


def test_paced_starts_offer_one_line_per_endpoint_not_in_a_batch_prefill() -> None:
    """Several batch prompts prefilled at once fill the engine's steps in front of an interactive
    arrival: with `paced_starts` an endpoint takes one new line, and none while the last one placed
    there is still within its predicted prefill."""
    paced = replace(LIMITS, paced_starts=True)
    endpoints = [endpoint("a"), endpoint("b"), endpoint("c", waiting=1)]
    assert pool_spare_slots(endpoints, paced, NOW, {"p/a": 1}) == 2  # a and b one each; c queues
    assert pool_spare_slots(endpoints, paced, NOW, {"p/a": 1}, prefilling=lambda e: e == "p/a") == 1
    busy = endpoint(inflight=1)
    assert endpoint_spare(busy, paced, NOW, 1, prefilling=True) == REASON_BATCH_PREFILLING
    assert endpoint_spare(busy, LIMITS, NOW, 1, prefilling=True) is None  # off by default


def test_tightest_objectives() -> None:
    assert tightest([Objectives(1000, None), Objectives(500, 80), Objectives(None, 40)]) == Objectives(500, 40)
    assert tightest(iter([])) == Objectives()

"""Saturation per endpoint and pool: engine queue (scraped or implied), KV usage, in-flight, predicted TTFT."""

from __future__ import annotations

import pytest

from backends.types import Endpoint, EndpointState, EndpointStats
from policies.flow.saturation import (
    REASON_ENGINE_QUEUE,
    REASON_INFLIGHT,
    REASON_KV_USAGE,
    REASON_PREDICTED_TTFT,
    SaturationLimits,
    endpoint_saturation,
    engine_waiting,
    open_endpoints,
)

NOW = 1000.0


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
    stats = EndpointStats(
        running=running, waiting=waiting, kv_usage_ratio=kv, scraped_at_s=NOW - age_s if age_s else 0.0
    )
    e = Endpoint(
        id=f"p/{name}", pool="p", base_url="http://x", engine="sim", served_model="m", state=state, stats=stats
    )
    e.inflight.requests = inflight
    return e


@pytest.mark.parametrize(
    ("e", "limits", "predicted", "reason"),
    [
        pytest.param(endpoint(), SaturationLimits(), None, None, id="idle"),
        pytest.param(endpoint(waiting=6), SaturationLimits(), None, REASON_ENGINE_QUEUE, id="engine-queue-over-5"),
        pytest.param(endpoint(waiting=5), SaturationLimits(), None, None, id="engine-queue-at-5"),
        pytest.param(endpoint(kv=0.95), SaturationLimits(), None, REASON_KV_USAGE, id="kv-over-0.8"),
        pytest.param(
            endpoint(inflight=12),
            SaturationLimits(max_engine_waiting=1, max_num_seqs=10),
            None,
            REASON_ENGINE_QUEUE,
            id="queue-implied-by-own-inflight-over-batch",
        ),
        pytest.param(
            endpoint(waiting=9, kv=0.99, age_s=30.0), SaturationLimits(), None, None, id="stale-stats-are-not-read"
        ),
        pytest.param(
            endpoint(age_s=None, inflight=3),
            SaturationLimits(max_inflight=3),
            None,
            REASON_INFLIGHT,
            id="own-inflight-cap-without-stats",
        ),
        pytest.param(
            endpoint(),
            SaturationLimits(max_predicted_ttft_ms=200),
            250.0,
            REASON_PREDICTED_TTFT,
            id="predicted-ttft-over-the-pool-threshold",
        ),
        pytest.param(endpoint(), SaturationLimits(max_predicted_ttft_ms=200), 150.0, None, id="predicted-ttft-under"),
        pytest.param(endpoint(waiting=50, kv=1.0), SaturationLimits(None, None), None, None, id="limits-off"),
    ],
)
def test_endpoint_saturation(
    e: Endpoint, limits: SaturationLimits, predicted: float | None, reason: str | None
) -> None:
    assert endpoint_saturation(e, limits, NOW, predicted) == reason


def test_engine_waiting_takes_the_larger_of_scraped_and_implied() -> None:
    limits = SaturationLimits(max_num_seqs=4)
    assert engine_waiting(endpoint(waiting=2, inflight=3), limits, NOW) == 2
    assert engine_waiting(endpoint(waiting=2, inflight=9), limits, NOW) == 6  # 9 + this one - 4
    assert engine_waiting(endpoint(waiting=2, inflight=9), SaturationLimits(), NOW) == 2  # batch size unknown


def test_the_pool_is_saturated_only_when_no_ready_endpoint_can_start_a_request() -> None:
    busy, free = endpoint("busy", waiting=10), endpoint("free")
    draining = endpoint("draining", state=EndpointState.DRAINING)
    assert [e.id for e in open_endpoints([busy, free, draining], SaturationLimits(), NOW)] == ["p/free"]
    assert open_endpoints([busy, draining], SaturationLimits(), NOW) == []
    # a prediction over the threshold closes only the endpoint it was made for
    limits = SaturationLimits(max_predicted_ttft_ms=100)
    assert open_endpoints([free], limits, NOW, {"p/free": 300.0}) == []

"""The stall watch's verdicts (gateway/upstream/replica_loss.py) over real endpoints and pools, on a test clock:
first-token deadlines from the predictor's p90, clamped; a replica silent with streams in flight, or
silent with its metrics silent too, is stalled (ejected within the pool's cap, every call on it cut);
deadline misses count only while the replica shows no life between them; a busy replica is not."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from backends.config import EjectionSettings
from backends.fleet import Fleet, Pool
from backends.types import Endpoint, EndpointState
from gateway.app.settings import FirstTokenDeadline
from gateway.upstream.replica_loss import DEADLINE, STALLED, StallWatch
from predictor.features import Prediction
from tests.backends.builders import pool


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def fleet_of(count: int) -> Fleet:
    p = Pool(pool(endpoints=[{"url": f"http://127.0.0.1:{1000 + i}"} for i in range(count)]))
    p.endpoints = [
        Endpoint(
            id=f"{p.name}/both-{i}",
            pool=p.name,
            base_url=f"http://127.0.0.1:{1000 + i}",
            engine="vllm",
            served_model="m",
            state=EndpointState.READY,
        )
        for i in range(count)
    ]
    return Fleet([p])


def state(endpoint: Endpoint) -> EndpointState:
    return endpoint.state  # read afresh (the watch changes it)


def watch_of(fleet: Fleet, clock: Clock, **deadline: Any) -> StallWatch:
    return StallWatch(fleet, FirstTokenDeadline(**deadline), 10.0, EjectionSettings(), clock)


def prediction(ttft_p90_ms: float) -> Prediction:
    return Prediction(
        endpoint_id="p/both-0", ttft_ms=ttft_p90_ms / 2, tpot_ms=10.0, ttft_p90_ms=ttft_p90_ms, tpot_p90_ms=20.0,
        ttft_source="model", tpot_source="model", features=np.zeros(4, dtype=np.float32),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("p90_ms", "expected_s"),
    [
        pytest.param(None, 10.0, id="no-prediction-the-default"),
        pytest.param(2_000.0, 6.0, id="factor-times-p90"),
        pytest.param(100.0, 2.0, id="clamped-to-min"),
        pytest.param(60_000.0, 30.0, id="clamped-to-max"),
    ],
)
def test_the_deadline_follows_the_predicted_p90_within_bounds(p90_ms: float | None, expected_s: float) -> None:
    stalls = watch_of(fleet_of(2), Clock())
    assert stalls.deadline_s(None if p90_ms is None else prediction(p90_ms)) == pytest.approx(expected_s)


def test_a_silent_replica_with_streams_in_flight_is_stalled_and_its_calls_cut() -> None:
    fleet, clock = fleet_of(2), Clock()
    stalls = watch_of(fleet, clock)
    frozen, other = fleet.pools["p"].endpoints
    calls = [stalls.begin(frozen, stream=True), stalls.begin(frozen, stream=False)]
    busy = stalls.begin(other, stream=True)
    clock.now_s += 9.0
    stalls.check()
    assert state(frozen) is EndpointState.READY  # not yet: silent for less than stall_after_s
    other.inflight.last_token_s = clock.now_s + 1.5  # the other relays tokens
    clock.now_s += 1.5
    stalls.check()
    assert frozen.state is EndpointState.UNHEALTHY and "stalled" in frozen.state_reason
    assert [c.reason for c in calls] == [STALLED, STALLED]
    assert other.state is EndpointState.READY and busy.reason == ""


def test_long_non_streamed_work_is_not_a_stall_while_the_metrics_answer() -> None:
    fleet, clock = fleet_of(2), Clock()
    stalls = watch_of(fleet, clock)
    engine = fleet.pools["p"].endpoints[0]
    call = stalls.begin(engine, stream=False)  # a long generation shows no byte until its end
    for _ in range(5):
        clock.now_s += 5.0
        engine.stats.scraped_at_s = clock.now_s  # its /metrics answers: alive
        stalls.check()
    assert state(engine) is EndpointState.READY and call.reason == ""
    clock.now_s += 10.0  # and now its metrics stopped answering too: frozen
    stalls.check()
    assert engine.state is EndpointState.UNHEALTHY and call.reason == STALLED


def test_missed_deadlines_stall_a_replica_only_without_life_between_them() -> None:
    fleet, clock = fleet_of(2), Clock()
    stalls = watch_of(fleet, clock, misses_to_stall=2)
    busy, frozen = fleet.pools["p"].endpoints
    stalls.missed_first_token(busy)
    clock.now_s += 1.0
    busy.inflight.last_token_s = clock.now_s  # it relayed tokens for others: slow, not frozen
    clock.now_s += 1.0
    stalls.missed_first_token(busy)
    assert busy.state is EndpointState.READY

    waiting = stalls.begin(frozen, stream=True)
    stalls.missed_first_token(frozen)
    clock.now_s += 1.0
    stalls.missed_first_token(frozen)
    assert frozen.state is EndpointState.UNHEALTHY
    assert waiting.reason == STALLED
    assert stalls.stalls == 1


def test_the_last_replica_stays_in_routing_but_its_calls_still_end() -> None:
    fleet, clock = fleet_of(1), Clock()
    stalls = watch_of(fleet, clock)
    only = fleet.pools["p"].endpoints[0]
    call = stalls.begin(only, stream=True)
    clock.now_s += 11.0
    stalls.check()
    assert only.state is EndpointState.READY  # never the last one out (the ejection cap)
    assert call.reason == STALLED  # but its stream ends instead of hanging


def test_an_ended_call_is_forgotten() -> None:
    fleet, clock = fleet_of(2), Clock()
    stalls = watch_of(fleet, clock)
    engine = fleet.pools["p"].endpoints[0]
    stalls.end(stalls.begin(engine, stream=True))
    clock.now_s += 60.0
    stalls.check()
    assert engine.state is EndpointState.READY
    assert DEADLINE != STALLED


def test_a_replica_is_judged_once_for_the_calls_it_had() -> None:
    """Calls cut already (a stream continuing on another replica keeps its first call until it ends)
    are not judged again: one verdict, not one per pass."""
    fleet, clock = fleet_of(2), Clock()
    stalls = watch_of(fleet, clock)
    frozen = fleet.pools["p"].endpoints[0]
    stalls.begin(frozen, stream=True)
    for _ in range(5):
        clock.now_s += 11.0
        stalls.check()
    assert stalls.stalls == 1

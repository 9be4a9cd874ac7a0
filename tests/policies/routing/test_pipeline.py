"""The scoring router over plain endpoints: affinity, the load gate, hot spots, sessions, staleness."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from backends.types import Endpoint, EndpointState
from policies.routing.components import MaxScorePicker
from policies.routing.config import RoutingConfig
from policies.routing.pipeline import Pipeline, ScoringRouter, WeightedScorer, build_router, check_consumes
from policies.routing.types import RouteDecision, Router, RouteRequest
from tests.policies.routing.factories import NOW_S, candidate, context, endpoint, endpoints, pool, request, token_ids
from tests.policies.routing.prefix.events import batch, removed, stored

SHARED = token_ids(4000)


def router(**config: Any) -> ScoringRouter:
    return build_router({"seed": 7, **config})


def dispatch(r: ScoringRouter, f: RouteRequest, eps: list[Endpoint], *, first_token: bool) -> RouteDecision:
    """Route, commit, and account the request in flight as the gateway does (optionally past prefill)."""
    d = r.route(f, pool(eps), NOW_S)
    assert d is not None
    r.on_dispatch(f, d)
    ticket = d.endpoint.inflight.begin(d.uncached_prefill_tokens(f.facts.prompt_tokens))
    if first_token:
        ticket.first_token(f.facts.prompt_tokens + 100)
    return d


def with_suffix(i: int) -> RouteRequest:
    return request(SHARED + token_ids(96, start=1000 + i), request_id=f"r{i}")


def test_shared_prefix_goes_to_holder_until_load_gate_then_spreads() -> None:
    r, eps = router(), endpoints(4)
    decisions = [dispatch(r, with_suffix(i), eps, first_token=True) for i in range(12)]
    holder = decisions[0].endpoint.id
    # the holder takes requests while its in-flight count is within the gate (8 over the least loaded)
    assert [d.endpoint.id for d in decisions[:9]] == [holder] * 9
    assert [d.reason for d in decisions[1:9]] == ["prefix-hit"] * 8
    # then the 10th spreads to another replica, which becomes a second holder
    assert decisions[9].endpoint.id != holder and decisions[9].reason == "load"
    assert decisions[10].endpoint.id == decisions[9].endpoint.id and decisions[10].reason == "prefix-hit"


def test_holder_that_is_busier_than_the_saving_loses_before_the_gate() -> None:
    r, eps = router(), endpoints(2)
    first = dispatch(r, with_suffix(0), eps, first_token=True)
    first.endpoint.inflight.prefill_tokens += 20_000  # a long uncached prefill queued on the holder
    second = dispatch(r, with_suffix(1), eps, first_token=True)
    assert second.endpoint is not first.endpoint and second.reason == "load"


def test_identical_concurrent_prompts_do_not_all_land_on_one_replica() -> None:
    r, eps = router(), endpoints(8)
    prompt = token_ids(4096)
    picks = Counter(
        dispatch(r, request(prompt, request_id=f"r{i}"), eps, first_token=False).endpoint.id for i in range(40)
    )
    assert max(picks.values()) <= 9
    assert len(picks) >= 4


def test_idle_fleet_spreads_unrelated_prompts() -> None:
    r, eps = router(), endpoints(4)
    picks = Counter(
        dispatch(r, request(token_ids(512, start=i + 1)), eps, first_token=False).endpoint.id for i in range(16)
    )
    assert len(picks) == 4 and max(picks.values()) <= 6


@pytest.mark.parametrize(
    ("session", "user"),
    [pytest.param("conv-1", None, id="header"), pytest.param(None, "alice", id="user-field")],
)
def test_session_affinity_holds(session: str | None, user: str | None) -> None:
    r, eps = router(), endpoints(4)
    decisions = [
        dispatch(r, request(token_ids(300, start=i + 1), session_key=session, user=user), eps, first_token=True)
        for i in range(5)
    ]
    assert {d.endpoint.id for d in decisions} == {decisions[0].endpoint.id}
    assert [d.reason for d in decisions[1:]] == ["session"] * 4


def test_session_moves_when_its_endpoint_crosses_the_gate() -> None:
    r, eps = router(), endpoints(2)
    first = dispatch(r, request(token_ids(300), session_key="s"), eps, first_token=True)
    first.endpoint.inflight.requests += 20
    moved = dispatch(r, request(token_ids(300, start=2), session_key="s"), eps, first_token=True)
    assert moved.endpoint is not first.endpoint
    again = dispatch(r, request(token_ids(300, start=3), session_key="s"), eps, first_token=True)
    assert again.endpoint is moved.endpoint and again.reason == "session"


@pytest.mark.parametrize(
    ("scraped", "expected_reason", "allowed"),
    [
        pytest.param([NOW_S - 10, NOW_S, NOW_S], "load", {"e1", "e2"}, id="stale-holder-is-saturated"),
        pytest.param([NOW_S - 10] * 3, "fallback", {"e0"}, id="all-stale-fallback"),
        pytest.param([0.0] * 3, "prefix-hit", {"e0"}, id="never-scraped-pool-is-not-stale"),
    ],
)
def test_stale_stats_count_as_saturated(scraped: list[float], expected_reason: str, allowed: set[str]) -> None:
    r = router()
    eps = [endpoint(f"e{i}", scraped_at_s=s) for i, s in enumerate(scraped)]
    r.index.record(request(SHARED).prompt, eps[0], NOW_S)
    d = r.route(request(SHARED), pool(eps), NOW_S)
    assert d is not None and d.endpoint.id in allowed and d.reason == expected_reason


def test_filters_that_reject_everyone_fall_back() -> None:
    r = router()
    eps = endpoints(2, max_model_len=1024)
    d = r.route(request(token_ids(2000)), pool(eps), NOW_S)
    assert d is not None and d.reason == "fallback"


@pytest.mark.parametrize(
    ("states", "exclude", "expected"),
    [
        pytest.param(["ready", "ready"], {"e0"}, "e1", id="excluded"),
        pytest.param(["draining", "ready"], set(), "e1", id="not-ready"),
        pytest.param(["ready", "ready"], {"e0", "e1"}, None, id="nothing-left"),
        pytest.param(["dead", "starting"], set(), None, id="none-ready"),
    ],
)
def test_candidates(states: list[str], exclude: set[str], expected: str | None) -> None:
    eps = [endpoint(f"e{i}", state=EndpointState(s)) for i, s in enumerate(states)]
    d = router().route(request(SHARED), pool(eps), NOW_S, exclude=exclude)
    assert (d.endpoint.id if d else None) == expected
    if d is not None:
        assert d.reason == "only"


def test_debug_header_carries_reason_and_scores() -> None:
    r, eps = router(), endpoints(2)
    r.index.record(request(SHARED).prompt, eps[1], NOW_S)
    d = r.route(request(SHARED, debug=True), pool(eps), NOW_S)
    assert d is not None and d.reason == "prefix-hit"
    header = d.debug_header()
    assert header.startswith("reason=prefix-hit; endpoint=e1; cached=3968")
    assert "e0=[work-cost:" in header and "prefix-cache:0.992" in header and "total:" in header
    quiet = r.route(request(SHARED), pool(eps), NOW_S)
    assert quiet is not None and quiet.scores == {}


def test_baseline_router_per_pool() -> None:
    r = router(pools={"p": {"router": "round-robin"}})
    eps = endpoints(3)
    picks = [dispatch(r, request(SHARED), eps, first_token=False).endpoint.id for _ in range(3)]
    assert sorted(picks) == ["e0", "e1", "e2"]


def test_precise_mode_follows_engine_events() -> None:
    r = router(prefix_index={"mode": "precise"})
    eps = [endpoint(f"e{i}", engine="vllm") for i in range(3)]
    prompt = token_ids(2048)
    for e in eps:
        r.on_kv_batch(e.id, batch(at_s=NOW_S))
    r.on_kv_batch("e2", batch(stored(prompt), seq=1, at_s=NOW_S))
    d = r.route(request(prompt), pool(eps), NOW_S)
    assert d is not None and (d.endpoint.id, d.reason, d.cached_tokens_estimate) == ("e2", "prefix-hit", 2047)
    r.on_kv_batch("e2", batch(removed(prompt, [0]), seq=2, at_s=NOW_S))  # evicted: affinity gone
    after = r.route(request(prompt), pool(eps), NOW_S)
    assert after is not None and after.reason == "load" and after.cached_tokens_estimate == 0


def test_on_dispatch_records_for_retries_and_reports_memory() -> None:
    r, eps = router(), endpoints(2)
    f = request(SHARED)
    d = r.route(f, pool(eps), NOW_S)
    assert d is not None
    retry = r.route(f, pool(eps), NOW_S, exclude={d.endpoint.id})
    assert retry is not None and retry.endpoint is not d.endpoint
    r.on_dispatch(f, retry)
    report = r.report(NOW_S)
    assert report.index.approximate_entries == 62 and report.index.memory_bytes > 0


class _Constant:
    def __init__(self, values: list[float]) -> None:
        self.values = values

    def score(self, ctx: object, candidates: object) -> list[float]:
        return self.values


class _Nobody:
    def filter(self, ctx: object, candidates: object) -> list[object]:
        return []


def test_pipeline_clamps_and_weights_scores() -> None:
    pipeline = Pipeline(
        filters=[_Nobody()],  # type: ignore[list-item]
        scorers=[
            WeightedScorer("a", 3.0, _Constant([2.0, float("nan"), -1.0, 0.5])),
            WeightedScorer("b", 1.0, _Constant([0.0, 1.0, 1.0, 1.0])),
            WeightedScorer("ignored", 0.0, _Constant([9.0, 9.0, 9.0, 9.0])),
        ],
        picker=MaxScorePicker(),
    )
    choice = pipeline.choose(context(), [candidate(endpoint(f"e{i}")) for i in range(4)], random.Random(0))
    assert choice.scores["a"] == [1.0, 0.0, 0.0, 0.5]
    assert choice.totals == pytest.approx([0.75, 0.25, 0.25, 0.625])
    assert "ignored" not in choice.scores
    assert choice.chosen.id == "e0" and choice.fallback  # the filter left nobody: skipped


def test_scoring_router_is_a_router() -> None:
    r: Router = build_router()  # the Router protocol the gateway calls (checked by mypy)
    assert r.route(request(SHARED), pool([endpoint("a")]), NOW_S, exclude={"a"}) is None


@pytest.mark.parametrize(
    ("config", "predictor", "warned"),
    [
        pytest.param({}, False, [], id="default-pipeline"),
        pytest.param(
            {"default": {"scorers": [{"type": "latency"}]}},
            False,
            ["routing.default: scorer 'latency' needs 'predictions', which is not configured"],
            id="latency-without-predictor",
        ),
        pytest.param({"default": {"scorers": [{"type": "latency"}]}}, True, [], id="latency-with-predictor"),
        pytest.param(
            {"prefix_index": {"mode": "off"}, "default": {"scorers": [{"type": "prefix-cache"}]}},
            False,
            ["routing.default: scorer 'prefix-cache' needs 'prefix-index', which is not configured"],
            id="prefix-cache-without-index",
        ),
    ],
)
def test_declared_inputs_are_checked_at_build_time(config: dict[str, Any], predictor: bool, warned: list[str]) -> None:
    assert check_consumes(RoutingConfig.model_validate(config), predictor=predictor) == warned

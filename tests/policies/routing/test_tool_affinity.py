"""Tool-boundary affinity: the scorer, the TTL learnt from tool-call gaps, the table's bounds, and the
router keeping a program's return on the replica that served its tool-call answer."""

from __future__ import annotations

import dataclasses
import random

import pytest

from policies.routing.pipeline import build_router
from policies.routing.tool_affinity import GapLearner, PendingReturn, ToolAffinityScorer, ToolReturns
from policies.routing.types import RouteRequest
from policies.types import RequestSubjects
from tests.policies.routing.factories import NOW_S, candidate, context, endpoint, facts, pool, token_ids


def _back(endpoint_id: str) -> PendingReturn:
    return PendingReturn("p", endpoint_id, 4000, NOW_S - 1.0)


@pytest.mark.parametrize(
    ("holder_kv", "expected_holder"),
    [
        pytest.param(0.5, 1.0, id="room-scores-one"),
        pytest.param(0.9, 1.0, id="at-threshold-still-one"),
        pytest.param(0.95, 0.5, id="over-threshold-weighed-down"),
        pytest.param(1.0, 0.0, id="full-scores-zero"),
    ],
)
def test_returning_program_scores_its_holder(holder_kv: float, expected_holder: float) -> None:
    cands = [candidate(endpoint("e0")), candidate(endpoint("e1", kv_usage_ratio=holder_kv)), candidate(endpoint("e2"))]
    ctx = context()
    ctx.tool_return = _back("e1")
    scores = ToolAffinityScorer(pressure_threshold=0.9).score(ctx, cands)
    assert scores[0] == 0.0 and scores[2] == 0.0
    assert scores[1] == pytest.approx(expected_holder)


def test_other_requests_see_pending_returns_as_used_kv() -> None:
    cands = [candidate(endpoint(f"e{i}", num_gpu_blocks=1000, block_size=16)) for i in range(3)]  # 16k tokens each
    ctx = context()
    ctx.reserved_tokens = {"e0": 8000, "e1": 32000}
    assert ToolAffinityScorer().score(ctx, cands) == [0.5, 0.0, 1.0]


def test_no_pending_returns_scores_every_fresh_candidate_alike() -> None:
    cands = [candidate(endpoint("e0")), candidate(endpoint("e1"), saturated=True)]
    assert ToolAffinityScorer().score(context(), cands) == [1.0, 0.0]


def test_bad_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="pressure_threshold"):
        ToolAffinityScorer(pressure_threshold=1.0)


def test_ttl_is_the_p90_of_the_gaps_clamped() -> None:
    learner = GapLearner(min_samples=5, default_ttl_s=30.0)
    assert learner.ttl_s("t") == 30.0  # nothing learnt yet
    for gap in (2.0, 3.0, 4.0, 5.0):
        learner.observe("t", gap)
    assert learner.ttl_s("t") == 30.0  # fewer than min_samples
    for gap in (6.0, 7.0, 8.0, 9.0, 10.0, 11.0):
        learner.observe("t", gap)
    assert learner.ttl_s("t") == 11.0  # p90 of 2..11
    assert learner.ttl_s("other") == 30.0  # per tenant
    fast = GapLearner(min_samples=1, min_ttl_s=1.0, max_ttl_s=300.0)
    fast.observe("t", 0.01)
    assert fast.ttl_s("t") == 1.0
    fast.observe("u", 5000.0)
    assert fast.ttl_s("u") == 300.0
    fast.observe("t", float("nan"))
    fast.observe("t", -1.0)
    assert fast.ttl_s("t") == 1.0  # nonsense gaps teach nothing


def test_learner_keeps_the_last_window_and_a_bounded_set_of_tenants() -> None:
    learner = GapLearner(window=4, min_samples=1, max_tenants=2)
    for gap in (100.0, 100.0, 100.0, 100.0, 2.0, 2.0, 2.0, 2.0):
        learner.observe("t", gap)
    assert learner.ttl_s("t") == 2.0  # the old gaps left the window
    learner.observe("u", 50.0)
    learner.observe("v", 50.0)
    assert len(learner) == 2 and learner.ttl_s("t") == learner.default_ttl_s  # t, least recent, forgotten


def test_returns_reserve_until_their_ttl_then_linger_for_learning() -> None:
    table = ToolReturns(GapLearner(default_ttl_s=10.0, min_samples=1, max_ttl_s=100.0))
    table.note_tool_call("t", "prog", "p", "e1", 5000, now_s=0.0)
    assert table.pending("t", "prog", "p", 5.0) is not None
    assert table.pending("t", "prog", "other-pool", 5.0) is None
    assert table.pending("u", "prog", "p", 5.0) is None  # programs are per tenant
    assert dict(table.reserved("p", 5.0)) == {"e1": 5000}
    assert table.pending("t", "prog", "p", 11.0) is None
    assert dict(table.reserved("p", 11.0)) == {}  # past the TTL: no longer reserved...
    table.returned_now("t", "prog", 40.0)  # ...but a late return still teaches its gap
    assert table.learner.ttl_s("t") == 40.0
    assert len(table) == 0


def test_a_return_forgets_its_entry_and_learns_the_gap() -> None:
    table = ToolReturns(GapLearner(min_samples=1))
    table.note_tool_call("t", "prog", "p", "e1", 5000, now_s=100.0)
    table.note_tool_call("t", "prog2", "p", "e1", 3000, now_s=100.0)
    table.returned_now("t", "prog", 107.0)
    assert table.learner.ttl_s("t") == 7.0
    assert dict(table.reserved("p", 107.0)) == {"e1": 3000}
    assert table.returned == 1 and table.noted == 2


def test_table_is_bounded_per_tenant_and_in_tenants() -> None:
    table = ToolReturns(GapLearner(max_tenants=2), max_programs_per_tenant=3)
    for i in range(10):
        table.note_tool_call("t", f"prog{i}", "p", "e0", 100, now_s=float(i))
    assert len(table) == 3
    assert dict(table.reserved("p", 10.0)) == {"e0": 300}  # the forgotten ones stopped reserving
    assert table.pending("t", "prog9", "p", 10.0) is not None
    assert table.pending("t", "prog0", "p", 10.0) is None
    table.note_tool_call("u", "a", "p", "e1", 100, now_s=10.0)
    table.note_tool_call("v", "a", "p", "e1", 100, now_s=10.0)
    assert table.pending("t", "prog9", "p", 10.0) is None  # tenant t, least recent, forgotten
    assert dict(table.reserved("p", 10.0)) == {"e1": 200}


def _program_request(ids: list[int], program: str) -> RouteRequest:
    return RouteRequest(dataclasses.replace(facts(ids), subjects=RequestSubjects(program=program)))


def test_router_keeps_a_returning_program_on_its_holder_against_load() -> None:
    """The holder is busier than the others: without the scorer load moves the return away; with it
    (and room in the holder's KV) the return stays, reason `tool-return`; a full holder lets it go."""
    pipeline = {
        "filters": [],
        "scorers": [{"type": "work-cost", "weight": 3}, {"type": "tool-affinity", "weight": 3}],
        "picker": {"type": "max-score"},
    }
    router = build_router({"default": pipeline, "max_stats_age_s": 100}, rng=random.Random(0))
    eps = [endpoint("e0"), endpoint("e1"), endpoint("e2")]
    p = pool(eps)
    first = _program_request(token_ids(2000), "prog")
    decision = router.route(first, p, NOW_S)
    assert decision is not None
    holder = decision.endpoint
    router.on_dispatch(first, decision)
    router.note_tool_call(first.facts, decision, 2100, NOW_S + 1.0)
    holder.inflight.prefill_tokens = 6000  # unrelated work landed there meanwhile
    back = _program_request(token_ids(2500), "prog")
    again = router.route(back, p, NOW_S + 3.0)
    assert again is not None and again.endpoint is holder and again.reason == "tool-return"
    stranger = _program_request(token_ids(2500, start=9), "other")
    elsewhere = router.route(stranger, p, NOW_S + 3.0)
    assert elsewhere is not None and elsewhere.endpoint is not holder
    holder.stats.kv_usage_ratio = 1.0  # full: the return is weighed, not forced
    full = router.route(back, p, NOW_S + 3.0)
    assert full is not None and full.endpoint is not holder
    holder.stats.kv_usage_ratio = 0.2
    router.on_dispatch(back, again)  # the return went: the gap (2 s) is learnt, the entry gone
    assert router.tool_returns.returned == 1
    assert router.tool_returns.pending("t", "prog", "p", NOW_S + 3.0) is None


def test_a_return_dispatched_by_another_replica_ends_the_entry_and_teaches_the_gap() -> None:
    table = ToolReturns(GapLearner(min_samples=1))
    table.note_tool_call("t", "prog", "p", "e1", 5000, now_s=100.0)
    assert table.returned_now("t", "other", 101.0) is None  # nothing pending: nothing to tell the others
    table.returned_elsewhere("t", "prog", 4.0)
    assert table.pending("t", "prog", "p", 102.0) is None
    assert dict(table.reserved("p", 102.0)) == {}
    assert table.learner.ttl_s("t") == 4.0

"""The SLO decision over plain predictions: what meets, what a miss does, who is shed; SLO classes in
policies.yaml (validation with key paths, assignment per tenant and per priority)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from policies.policy import Policy, hash_key
from policies.schema import PoliciesConfig
from policies.slo import Meet, Miss, Slo, check_endpoint, decide, effective_slo
from predictor.features import NUM_FEATURES, Feature, Prediction, Target

FAST = Slo(ttft_ms=200.0, tpot_ms=20.0, on_miss="fallback", class_name="fast")


def P90(ttft_ms: float | None, tpot_ms: float | None) -> Slo:
    return Slo(ttft_ms, tpot_ms, compare="p90")


def prediction(
    endpoint_id: str,
    ttft_ms: float,
    tpot_ms: float = 10.0,
    *,
    p90: float = 1.5,
    running: int = 1,
) -> Prediction:
    features = np.zeros(NUM_FEATURES, dtype=np.float32)
    features[Feature.RUNNING] = running
    features[Feature.INFLIGHT_REQUESTS] = running
    return Prediction(
        endpoint_id=endpoint_id,
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        ttft_p90_ms=ttft_ms * p90,
        tpot_p90_ms=tpot_ms * p90,
        ttft_source="prior",
        tpot_source="prior",
        features=features,
    )


# --- the effective SLO ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slo_class", "headers", "expected"),
    [
        pytest.param(None, (None, None), None, id="none"),
        pytest.param(FAST, (None, None), (200.0, 20.0, "fallback"), id="class"),
        pytest.param(FAST, (100.0, None), (100.0, 20.0, "fallback"), id="header-tightens"),
        pytest.param(FAST, (500.0, 50.0), (200.0, 20.0, "fallback"), id="header-cannot-loosen"),
        pytest.param(
            Slo(ttft_ms=300.0, tpot_ms=None, on_miss="reject", class_name="t"),
            (None, 15.0),
            (300.0, 15.0, "reject"),
            id="header-adds-a-target",
        ),
        pytest.param(None, (80.0, None), (80.0, None, "proceed"), id="header-only-proceeds"),
    ],
)
def test_effective_slo(
    slo_class: Slo | None, headers: tuple[float | None, float | None], expected: tuple[Any, ...] | None
) -> None:
    slo = effective_slo(slo_class, *headers)
    assert (None if slo is None else (slo.ttft_ms, slo.tpot_ms, slo.on_miss)) == expected


# --- one endpoint ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slo", "kwargs", "expected"),
    [
        pytest.param(P90(200.0, None), {}, (-50.0, 0.0), id="p90-meets"),  # p90 150 vs 200
        pytest.param(P90(140.0, None), {}, (10.0, 0.0), id="p90-misses-where-mean-meets"),
        pytest.param(Slo(140.0, None, compare="mean"), {}, (-40.0, 0.0), id="mean-meets"),
        pytest.param(P90(200.0, None), {"elapsed_ms": 80.0}, (30.0, 0.0), id="elapsed-eats-the-budget"),
        pytest.param(P90(None, 20.0), {}, (0.0, -5.0), id="tpot-meets"),
        pytest.param(P90(None, 20.0), {"running_tpot_slo_ms": 12.0}, (0.0, 3.0), id="running-slo-protected"),
        pytest.param(P90(200.0, None), {"running_tpot_slo_ms": 12.0}, (-50.0, 3.0), id="protected-without-own-tpot"),
    ],
)
def test_check_endpoint(slo: Slo, kwargs: dict[str, Any], expected: tuple[float, float]) -> None:
    check = check_endpoint(slo, prediction("a", 100.0, 10.0), **kwargs)
    assert (check.ttft_excess_ms, check.tpot_excess_ms) == pytest.approx(expected)
    assert check.meets == (max(expected) <= 0)


# median 100 / p90 150 ms TTFT, 10 / 15 ms TPOT: P(TTFT <= 140) = Phi(z90 ln 1.4 / ln 1.5) = 0.85,
# P(TTFT <= 100) = 0.5, P(TPOT <= 9) = Phi(z90 ln 0.9 / ln 1.5) = 0.37
@pytest.mark.parametrize(
    ("slo", "kwargs", "probability", "meets"),
    [
        pytest.param(Slo(140.0, None), {}, 0.85, True, id="likely-where-p90-misses"),
        pytest.param(Slo(100.0, None), {}, 0.5, True, id="the-median-is-even-odds"),
        pytest.param(Slo(100.0, None, min_probability=0.6), {}, 0.5, False, id="a-stricter-class"),
        pytest.param(Slo(140.0, 9.0), {}, 0.85 * 0.37, False, id="both-targets-multiply"),
        pytest.param(Slo(140.0, None), {"running_tpot_slo_ms": 9.0}, 0.85 * 0.37, False, id="running-slo-protected"),
        pytest.param(Slo(140.0, None), {"elapsed_ms": 40.0}, 0.5, True, id="elapsed-eats-the-budget"),
        pytest.param(Slo(140.0, None), {"elapsed_ms": 150.0}, 0.0, False, id="budget-spent"),
    ],
)
def test_check_endpoint_probability(slo: Slo, kwargs: dict[str, Any], probability: float, meets: bool) -> None:
    check = check_endpoint(slo, prediction("a", 100.0, 10.0), **kwargs)
    assert check.probability == pytest.approx(probability, abs=0.01)
    assert check.meets is meets


@pytest.mark.parametrize(
    ("median", "p90", "bound", "expected"),
    [
        pytest.param(100.0, 150.0, 150.0, 0.9, id="at-the-p90"),
        pytest.param(100.0, 150.0, 100.0, 0.5, id="at-the-median"),
        pytest.param(100.0, 150.0, 1e9, 1.0, id="far-above"),
        pytest.param(100.0, 100.0, 99.0, 0.0, id="no-spread-below"),
        pytest.param(100.0, 90.0, 100.0, 1.0, id="no-spread-at"),
        pytest.param(100.0, 150.0, 0.0, 0.0, id="nothing-left"),
        pytest.param(100.0, 150.0, -5.0, 0.0, id="overdue"),
    ],
)
def test_prediction_within(median: float, p90: float, bound: float, expected: float) -> None:
    p = prediction("a", median, p90=p90 / median)
    assert p.within(Target.TTFT, bound) == pytest.approx(expected, abs=1e-6)


# --- the decision ------------------------------------------------------------------------------------


def slo(on_miss: Any = "fallback", **kw: Any) -> Slo:
    return Slo(ttft_ms=kw.pop("ttft_ms", 200.0), tpot_ms=kw.pop("tpot_ms", 20.0), on_miss=on_miss, **kw)


@pytest.mark.parametrize(
    ("the_slo", "predictions", "priority", "floors", "expected"),
    [
        pytest.param(
            slo(), [prediction("a", 100), prediction("b", 300)], 0, {}, Meet(frozenset({"a"})), id="meets-on-one"
        ),
        pytest.param(
            slo(), [prediction("a", 100), prediction("b", 120)], 0, {}, Meet(frozenset({"a", "b"})), id="meets-on-both"
        ),
        pytest.param(
            slo(),
            [prediction("a", 100), prediction("b", 120)],
            0,
            {"a": 9.0},
            Meet(frozenset({"b"})),
            id="running-tpot-slo-excludes-a",
        ),
        pytest.param(
            slo(compare="p90"),
            [prediction("a", 100), prediction("b", 120)],
            0,
            {"a": 12.0},
            Meet(frozenset({"b"})),
            id="running-tpot-slo-excludes-a-p90",
        ),
        pytest.param(
            slo("fallback"), [prediction("a", 300), prediction("b", 400)], 0, {}, "fallback", id="miss-fallback"
        ),
        pytest.param(slo("queue"), [prediction("a", 300), prediction("b", 400)], 0, {}, "queue", id="miss-queue"),
        pytest.param(slo("reject"), [prediction("a", 300)], 0, {}, "reject", id="miss-reject"),
        pytest.param(slo("proceed"), [prediction("a", 300)], 0, {}, "proceed", id="miss-proceed"),
        pytest.param(slo("queue"), [prediction("a", 300)], -2, {}, "shed", id="sheddable-shed-not-queued"),
        pytest.param(slo("fallback"), [prediction("a", 300)], -1, {}, "shed", id="low-shed-not-fallen-back"),
        pytest.param(slo("proceed"), [prediction("a", 300)], -2, {}, "shed", id="sheddable-shed-header-only"),
        pytest.param(
            slo("queue"),
            [prediction("a", 300), prediction("b", 400, running=0)],
            0,
            {},
            Meet(frozenset({"b"}), idle_only=True),
            id="idle-endpoint-admits-on-a-miss",
        ),
        pytest.param(
            slo("reject"),
            [prediction("a", 300, running=0)],
            -2,
            {},
            Meet(frozenset({"a"}), idle_only=True),
            id="idle-endpoint-admits-sheddable-too",
        ),
    ],
)
def test_decide(
    the_slo: Slo, predictions: list[Prediction], priority: int, floors: dict[str, float], expected: Any
) -> None:
    verdict = decide(the_slo, predictions, priority=priority, running_tpot_slo_ms=floors)
    if isinstance(expected, Meet):
        assert verdict == expected
    else:
        assert isinstance(verdict, Miss) and verdict.action == expected


def test_miss_names_the_closest_endpoint_and_an_honest_retry_after() -> None:
    verdict = decide(slo("reject", compare="p90"), [prediction("a", 2000), prediction("b", 900)], priority=0)
    assert isinstance(verdict, Miss)
    assert verdict.closest.endpoint_id == "b"
    assert verdict.closest.ttft_excess_ms == pytest.approx(1150.0)  # p90 1350 - 200
    assert verdict.retry_after_s() == 2  # ceil(1.15 s)


def test_probability_miss_names_the_likeliest_endpoint() -> None:
    # a: fast TTFT but TPOT far over; b: both a little over the median: b is likelier
    predictions = [prediction("a", 50, 40), prediction("b", 260, 22)]
    verdict = decide(slo("reject"), predictions, priority=0)
    assert isinstance(verdict, Miss)
    assert verdict.closest.endpoint_id == "b"
    assert 0.0 < verdict.closest.probability < 0.5
    assert verdict.closest.ttft_excess_ms == pytest.approx(60.0)  # the median, 260 - 200
    assert verdict.retry_after_s() == 1


@pytest.mark.parametrize(
    ("excess_ms", "seconds"),
    [(0.0, 1), (10.0, 1), (1001.0, 2), (10**6, 60)],
    ids=["meets-ttft", "floor", "ceil", "cap"],
)
def test_retry_after_bounds(excess_ms: float, seconds: int) -> None:
    verdict = decide(
        slo("reject", ttft_ms=200.0, tpot_ms=1.0, compare="p90"), [prediction("a", (200 + excess_ms) / 1.5)], priority=0
    )
    assert isinstance(verdict, Miss) and verdict.retry_after_s() == seconds


def test_decide_needs_a_prediction() -> None:
    with pytest.raises(ValueError):
        decide(slo(), [], priority=0)


# --- SLO classes in policies.yaml ------------------------------------------------------------------


def doc(**extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "tenants": {"t": {"slo_class": "fast"}, "u": {"priority": "sheddable"}, "v": {}},
        "keys": [
            {"id": "kt", "tenant": "t", "sha256": hash_key("kt")},
            {"id": "ku", "tenant": "u", "sha256": hash_key("ku")},
            {"id": "kv", "tenant": "v", "sha256": hash_key("kv")},
            {"id": "kv-high", "tenant": "v", "sha256": hash_key("kv-high"), "priority": "high"},
        ],
        "slo_classes": {
            "fast": {"ttft_ms": 300, "tpot_ms": 30, "on_miss": "fallback"},
            "batch": {"ttft_ms": 5000, "on_miss": "queue", "max_queue_ms": 2000, "priorities": ["sheddable"]},
            "interactive": {"ttft_ms": 500, "priorities": ["high"]},
        },
    }
    base.update(extra)
    return base


def messages(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        PoliciesConfig.model_validate(data)
    return str(info.value)


def test_classes_assigned_per_tenant_then_per_priority() -> None:
    policy = Policy(PoliciesConfig.model_validate(doc()))

    def class_of(key: str) -> str | None:
        principal = policy.authenticate(key)
        assert principal is not None
        found = policy.slo_class(principal)
        return None if found is None else found.class_name

    assert class_of("kt") == "fast"  # the tenant's own class
    assert class_of("ku") == "batch"  # its priority's class
    assert class_of("kv") is None  # normal priority claims none
    assert class_of("kv-high") == "interactive"  # the key's priority overrides the tenant's
    principal = policy.authenticate("ku")
    assert principal is not None
    batch = policy.slo_class(principal)
    assert batch is not None and (batch.on_miss, batch.max_queue_ms, batch.tpot_ms) == ("queue", 2000.0, None)
    assert (batch.compare, batch.min_probability) == ("probability", 0.5)  # the defaults


def test_class_compare_settings_compile() -> None:
    data = doc()
    data["slo_classes"]["fast"] |= {"min_probability": 0.3}
    data["slo_classes"]["interactive"] |= {"compare": "p90"}
    policy = Policy(PoliciesConfig.model_validate(data))
    fast, interactive = (policy.slo_class(policy.authenticate(k)) for k in ("kt", "kv-high"))  # type: ignore[arg-type]
    assert fast is not None and (fast.compare, fast.min_probability) == ("probability", 0.3)
    assert interactive is not None and interactive.compare == "p90"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(
            {"tenants": {"t": {"slo_class": "nope"}}},
            "tenants.t.slo_class: unknown slo class 'nope'",
            id="unknown-class",
        ),
        pytest.param(
            {
                "slo_classes": {
                    "a": {"ttft_ms": 1, "priorities": ["low"]},
                    "b": {"ttft_ms": 1, "priorities": ["high", "low"]},
                }
            },
            "slo_classes.b.priorities[1]: priority 'low' already has class 'a'",
            id="priority-twice",
        ),
        pytest.param({"slo_classes": {"a": {"on_miss": "queue"}}}, "expected ttft_ms and/or tpot_ms", id="no-target"),
        pytest.param(
            {"slo_classes": {"a": {"ttft_ms": 100, "max_queue_ms": 50}}},
            "max_queue_ms only applies to on_miss: queue",
            id="stray-max-queue",
        ),
        pytest.param({"slo_classes": {"a": {"ttft_ms": -1}}}, "greater than 0", id="negative"),
        pytest.param({"slo_classes": {"a": {"ttft_ms": 10, "on_miss": "panic"}}}, "fallback", id="unknown-action"),
        pytest.param(
            {"slo_classes": {"a": {"ttft_ms": 10, "compare": "p90", "min_probability": 0.3}}},
            "min_probability only applies to compare: probability",
            id="stray-min-probability",
        ),
        pytest.param({"slo_classes": {"a": {"ttft_ms": 10, "min_probability": 1}}}, "less than 1", id="certainty"),
        pytest.param({"slo_classes": {"a": {"ttft_ms": 10, "compare": "p99"}}}, "probability", id="unknown-compare"),
    ],
)
def test_slo_class_problems(change: dict[str, Any], expected: str) -> None:
    data = doc(**change)
    if "slo_classes" in change:
        data["tenants"] = {"t": {}, "u": {}, "v": {}}
    assert expected in messages(data)

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from policies.routing.components import LatencyScorer, predict_candidates
from policies.routing.pipeline import build_router
from policies.routing.types import RouteContext
from policies.slo import Slo
from predictor.config import PredictorSettings
from predictor.features import NUM_FEATURES, Feature, Prediction
from predictor.service import LatencyPredictor
from tests.policies.routing.factories import NOW_S, candidate, context, endpoint, pool, request, token_ids
from tests.policies.routing.prefix.events import batch, removed, stored
from tests.policies.routing.prefix.test_tiers import offloaded


def prediction(endpoint_id: str, ttft_ms: float, tpot_ms: float, p90: float = 1.0) -> Prediction:
    return Prediction(
        endpoint_id,
        ttft_ms,
        tpot_ms,
        ttft_ms * p90,
        tpot_ms * p90,
        "prior",
        "prior",
        np.zeros(NUM_FEATURES, dtype=np.float32),
    )


def ctx(
    predicted: list[tuple[float, float]] | None,
    *,
    ttft_slo: float | None = None,
    tpot_slo: float | None = None,
    floors: dict[str, float] | None = None,
) -> RouteContext:
    c = context(slo=Slo(ttft_slo, tpot_slo) if ttft_slo is not None or tpot_slo is not None else None)
    if predicted is not None:
        c.predictions = {f"e{i}": prediction(f"e{i}", t, u) for i, (t, u) in enumerate(predicted)}
    if floors is not None:
        c.running_tpot_slo_ms = floors
    return c


@pytest.mark.parametrize(
    ("predicted", "slo", "expected"),
    [
        # both meet: 0.5 + 0.5 rel, rel = 1 for the fastest, 0.8 * 105/185 + 0.2 for the other
        pytest.param(
            [(100, 10), (180, 10)],
            {"ttft_slo": 200},
            [1.0, 0.5 + 0.5 * (0.8 * 105 / 185 + 0.2)],
            id="fastest-wins-among-those-that-meet",
        ),
        # a miss of 50 % scores 0.5/1.5, below every endpoint that meets, however slow that one is
        pytest.param([(190, 10), (300, 10)], {"ttft_slo": 200}, [1.0, 1 / 3], id="meets-outranks-misses"),
        pytest.param(
            [(10, 10), (190, 10), (300, 10)],
            {"ttft_slo": 200},
            [1.0, 0.5 + 0.5 * (0.8 * 15 / 195 + 0.2), 1 / 3],
            id="a-slow-meet-still-outranks-a-miss",
        ),
        pytest.param([(100, 10)], {"ttft_slo": 200, "tpot_slo": 20}, [1.0], id="both-targets"),
        # TPOT target missed by 50 % with TTFT fine: excess 0.2*0.5 / 1.0 = 0.1 -> 0.5/1.1
        pytest.param([(100, 30)], {"ttft_slo": 200, "tpot_slo": 20}, [0.5 / 1.1], id="tpot-miss-drops-tier"),
        # no SLO: relative predicted latency, s = 5 ms: 0.8 * 105/205 + 0.2 * 1 for e1
        pytest.param([(100, 10), (200, 10)], {}, [1.0, 0.8 * 105 / 205 + 0.2], id="no-slo-relative"),
        pytest.param([(100, 10), (100, 10)], {}, [1.0, 1.0], id="no-slo-equal"),
        pytest.param(None, {"ttft_slo": 200}, [1.0, 1.0], id="no-predictions-abstains"),
    ],
)
def test_latency_scores(
    predicted: list[tuple[float, float]] | None, slo: dict[str, Any], expected: list[float]
) -> None:
    n = len(expected)
    cands = [candidate(endpoint(f"e{i}")) for i in range(n)]
    assert LatencyScorer().score(ctx(predicted, **slo), cands) == pytest.approx(expected)


def test_running_tpot_slo_protects_requests_without_an_slo() -> None:
    # no SLO of its own, but e0 serves a request whose TPOT SLO is 12 ms: 15 ms there would break it
    scores = LatencyScorer().score(
        ctx([(50, 15), (80, 15)], floors={"e0": 12.0}), [candidate(endpoint("e0")), candidate(endpoint("e1"))]
    )
    assert scores[0] < 0.5 < scores[1]


def test_saturated_candidates_score_zero() -> None:
    cands = [candidate(endpoint("e0"), saturated=True), candidate(endpoint("e1"))]
    assert LatencyScorer().score(ctx([(10, 1), (100, 10)]), cands) == pytest.approx([0.0, 1.0])
    assert LatencyScorer().score(ctx([(10, 1), (100, 10)], ttft_slo=200), cands)[0] == 0.0


@pytest.mark.parametrize(
    "params",
    [{"ttft_weight": -1}, {"ttft_weight": 0, "tpot_weight": 0}, {"smoothing_ms": 0}],
    ids=["negative-weight", "zero-weights", "zero-smoothing"],
)
def test_latency_rejects_bad_params(params: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LatencyScorer(**params)


def test_predict_candidates_is_one_call_keyed_by_endpoint() -> None:
    predictor = LatencyPredictor(PredictorSettings(online_training=False), {})
    busy = endpoint("busy", running=40, prefill_tokens=20_000, requests=40)
    idle = endpoint("idle")
    c = context(prompt_tokens=1000)
    made = predict_candidates(predictor, pool([busy, idle]).name, "m", c, [candidate(busy), candidate(idle, 900)])
    assert set(made) == {"busy", "idle"}
    assert made["busy"].ttft_ms > made["idle"].ttft_ms  # backlog ahead of it, no cached prefix


def test_router_with_the_latency_scorer_prefers_the_endpoint_with_headroom() -> None:
    predictor = LatencyPredictor(PredictorSettings(online_training=False), {})
    router = build_router(
        {"seed": 1, "default": {"filters": [], "scorers": [{"type": "latency"}], "picker": {"type": "max-score"}}},
        predictor=predictor,
    )
    loaded = endpoint("loaded", running=60, waiting=4, requests=64, prefill_tokens=30_000, decode_tokens=120_000)
    free = endpoint("free", running=2, requests=2, decode_tokens=4_000)
    routed = request(list(range(800)), slo=Slo(500.0, None))
    decision = router.route(routed, pool([loaded, free]), NOW_S)
    assert decision is not None and decision.endpoint.id == "free"
    made = decision.predictions
    assert made is not None and set(made) == {"loaded", "free"} and made["loaded"].ttft_ms > made["free"].ttft_ms


def test_router_predicts_for_an_slo_even_without_the_latency_scorer() -> None:
    eps = [endpoint("a"), endpoint("b")]
    plain, with_slo = request(list(range(100))), request(list(range(100)), slo=Slo(None, 50.0))
    router = build_router({"seed": 1}, predictor=LatencyPredictor(PredictorSettings(online_training=False), {}))
    plain_decision = router.route(plain, pool(eps), NOW_S)
    slo_decision = router.route(with_slo, pool(eps), NOW_S)
    assert plain_decision is not None and plain_decision.predictions is None  # nothing would read them
    assert slo_decision is not None and slo_decision.predictions is not None
    assert set(slo_decision.predictions) == {"a", "b"}  # the SLO gate will


def test_router_predictions_carry_the_cached_tokens_per_tier() -> None:
    """The latency model's features split a candidate's cached tokens into HBM and lower tiers."""
    ids = token_ids(8000)
    predictor = LatencyPredictor(PredictorSettings(online_training=False), {})
    router = build_router(
        {"seed": 1, "prefix_index": {"mode": "precise"}, "default": {"filters": [], "scorers": [{"type": "latency"}]}},
        predictor=predictor,
    )
    held = list(range(4000 // 16))
    router.on_kv_batch("dram", batch(stored(ids[:4000]), removed(ids[:4000], held), offloaded(ids[:4000], held)))
    router.on_kv_batch("hbm", batch(stored(ids[:2000])))
    decision = router.route(request(ids), pool([endpoint("dram"), endpoint("hbm"), endpoint("cold")]), NOW_S)
    assert decision is not None and decision.predictions is not None
    rows = {k: p.features for k, p in decision.predictions.items()}
    assert (rows["dram"][Feature.CACHED_GPU_TOKENS], rows["dram"][Feature.CACHED_LOWER_TOKENS]) == (0, 4000)
    assert (rows["hbm"][Feature.CACHED_GPU_TOKENS], rows["hbm"][Feature.CACHED_LOWER_TOKENS]) == (2000, 0)
    assert rows["cold"][Feature.CACHED_TOKENS] == 0
    chosen = decision.cached_tiers
    assert chosen is not None and decision.cached_lower_tokens == chosen.lower

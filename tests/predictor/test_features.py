from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from backends.types import InFlight, Role
from predictor.features import FEATURE_NAMES, NUM_FEATURES, Feature, build_features
from tests.predictor.synthetic import endpoint, prior


def test_one_row_per_candidate_with_named_columns() -> None:
    latency_prior = prior()
    endpoints = [
        endpoint(0, running=10, waiting=0, kv=0.25, prefill_tokens=0, decode_tokens=12_000),
        endpoint(
            1, running=30, waiting=3, kv=0.8, requests=33, prefill_tokens=4_000, decode_tokens=40_000, role=Role.DECODE
        ),
    ]
    rows = build_features(2000, 300, endpoints, [1000, 0], latency_prior)
    assert rows.shape == (2, NUM_FEATURES) and rows.dtype == np.float32
    first, second = rows
    assert first[Feature.INPUT_TOKENS] == second[Feature.INPUT_TOKENS] == 2000
    assert (first[Feature.CACHED_TOKENS], first[Feature.UNCACHED_TOKENS]) == (1000, 1000)
    assert first[Feature.CACHED_RATIO] == pytest.approx(0.5)
    assert (second[Feature.CACHED_TOKENS], second[Feature.UNCACHED_TOKENS]) == (0, 2000)
    assert first[Feature.OUTPUT_TOKENS] == 300
    assert (second[Feature.RUNNING], second[Feature.WAITING], second[Feature.QUEUED]) == (30, 3, 1)
    assert first[Feature.QUEUED] == 0
    assert second[Feature.KV_USAGE_RATIO] == pytest.approx(0.8)
    assert second[Feature.INFLIGHT_REQUESTS] == 33
    assert second[Feature.INFLIGHT_PREFILL_TOKENS] == 4000
    assert second[Feature.INFLIGHT_DECODE_TOKENS] == 40_000
    assert (first[Feature.ROLE], second[Feature.ROLE]) == (0, 2)
    expected = latency_prior.estimate(2000, 0, 300, 30, 3, 33, 4000, 40_000, 0.0, -1.0)
    assert second[Feature.PRIOR_TTFT_MS] == pytest.approx(expected.ttft_ms, rel=1e-6)
    assert second[Feature.PRIOR_TPOT_MS] == pytest.approx(expected.tpot_ms, rel=1e-6)
    assert second[Feature.BATCH_REQUESTS] == expected.batch_requests
    assert second[Feature.PREFILL_STEPS] == expected.prefill_steps
    assert len(FEATURE_NAMES) == NUM_FEATURES and FEATURE_NAMES[Feature.KV_USAGE_RATIO] == "kv_usage_ratio"


def test_out_of_range_inputs_are_clipped() -> None:
    bad = endpoint(0, running=-2, waiting=-1, kv=1.7, requests=-3, prefill_tokens=-50, decode_tokens=-1)
    rows = build_features(100, 0, [bad, endpoint(1)], [500, -5], prior())
    assert rows[0, Feature.CACHED_TOKENS] == 100 and rows[0, Feature.UNCACHED_TOKENS] == 0
    assert rows[1, Feature.CACHED_TOKENS] == 0
    assert rows[0, Feature.KV_USAGE_RATIO] == 1.0
    assert rows[0, Feature.OUTPUT_TOKENS] == 1
    assert np.isfinite(rows).all()
    assert (np.delete(rows, Feature.SINCE_LAST_TOKEN_MS, axis=1) >= 0).all()


@dataclass(slots=True)
class _StreamingInFlight(InFlight):
    """InFlight as the gateway's relay will keep it (`last_token_s`, requested in backends.types)."""

    last_token_s: float = 0.0


def test_time_since_the_last_relayed_token_and_prefill_rate() -> None:
    busy = endpoint(0, running=20, decode_tokens=20 * 1000)
    busy.inflight = _StreamingInFlight(requests=20, decode_tokens=20 * 1000, last_token_s=99.995)
    never = endpoint(1, running=20, decode_tokens=20 * 1000)  # no token seen yet: unknown
    rows = build_features(1000, 100, [busy, never], [0, 0], prior(), [5000.0, -3.0], now_s=100.0)
    assert rows[0, Feature.SINCE_LAST_TOKEN_MS] == pytest.approx(5.0, abs=1e-3)
    assert rows[1, Feature.SINCE_LAST_TOKEN_MS] == -1
    assert (rows[0, Feature.PREFILL_RATE_TPS], rows[1, Feature.PREFILL_RATE_TPS]) == (5000, 0)
    # 5 ms into a step the engine is busy: less of the step is left than the prior assumes blind
    assert rows[0, Feature.PRIOR_TTFT_MS] != rows[1, Feature.PRIOR_TTFT_MS]


def test_empty_prompt_and_mismatched_lengths() -> None:
    rows = build_features(0, 10, [endpoint(0)], [0], prior())
    assert rows[0, Feature.CACHED_RATIO] == 0
    with pytest.raises(ValueError, match="cached-token"):
        build_features(100, 10, [endpoint(0), endpoint(1)], [0], prior())


def test_cached_tokens_split_by_tier() -> None:
    rows = build_features(4000, 10, [endpoint(0), endpoint(1), endpoint(2)], [3000, 3000, 500], prior(),
                          lower_cached_tokens=[1000, 0, 900])  # fmt: skip
    assert (rows[0, Feature.CACHED_GPU_TOKENS], rows[0, Feature.CACHED_LOWER_TOKENS]) == (2000, 1000)
    assert (rows[1, Feature.CACHED_GPU_TOKENS], rows[1, Feature.CACHED_LOWER_TOKENS]) == (3000, 0)
    assert (rows[2, Feature.CACHED_GPU_TOKENS], rows[2, Feature.CACHED_LOWER_TOKENS]) == (0, 500)  # clipped
    untiered = build_features(4000, 10, [endpoint(0)], [3000], prior())  # no split: all in HBM
    assert (untiered[0, Feature.CACHED_GPU_TOKENS], untiered[0, Feature.CACHED_LOWER_TOKENS]) == (3000, 0)

from __future__ import annotations

import numpy as np
import pytest

from predictor.config import LengthSettings
from predictor.length import OutputLengthEstimator


def test_estimates_follow_the_observed_distribution() -> None:
    estimator = OutputLengthEstimator(LengthSettings(half_life_samples=10_000))
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(mean=5.0, sigma=0.8, size=4000).astype(int) + 1
    for n in lengths:
        estimator.observe("acme", "llama", int(n))
    estimate = estimator.estimate("acme", "llama")
    assert estimate is not None
    assert estimate.mean_tokens == pytest.approx(lengths.mean(), rel=0.01)
    # log buckets are 2**(1/4) wide: within ~10 % of the exact quantiles
    assert estimate.p50_tokens == pytest.approx(np.quantile(lengths, 0.5), rel=0.1)
    assert estimate.p90_tokens == pytest.approx(np.quantile(lengths, 0.9), rel=0.1)
    assert estimate.p50_tokens < estimate.p90_tokens


def test_no_estimate_before_min_samples_then_model_wide_fallback() -> None:
    estimator = OutputLengthEstimator(LengthSettings(min_samples=5))
    assert estimator.estimate("acme", "llama") is None
    for _ in range(5):
        estimator.observe("acme", "llama", 100)
    estimator.observe("newcomer", "llama", 7)
    fallback = estimator.estimate("newcomer", "llama")  # 1 own sample: the model's 6 samples answer
    assert fallback is not None and fallback.samples == pytest.approx(6, rel=0.05)
    assert estimator.estimate("acme", "other-model") is None


def test_recent_usage_outweighs_old_usage() -> None:
    estimator = OutputLengthEstimator(LengthSettings(half_life_samples=50, min_samples=1))
    for _ in range(1000):
        estimator.observe("t", "m", 1000)
    for _ in range(300):  # six half-lives later the old regime weighs < 2 %
        estimator.observe("t", "m", 20)
    estimate = estimator.estimate("t", "m")
    assert estimate is not None
    assert estimate.p90_tokens == pytest.approx(20, rel=0.1)
    assert estimate.mean_tokens < 60


def test_keys_are_bounded() -> None:
    estimator = OutputLengthEstimator(LengthSettings(max_keys=10, min_samples=1))
    for i in range(100):
        estimator.observe(f"tenant-{i}", "m", 10)
    assert len(estimator) == 10
    assert estimator.estimate("tenant-99", "m") is not None


def test_zero_length_completions_count_and_negative_ones_do_not() -> None:
    estimator = OutputLengthEstimator(LengthSettings(min_samples=1))
    estimator.observe("t", "m", -1)
    assert estimator.estimate("t", "m") is None
    estimator.observe("t", "m", 0)
    estimate = estimator.estimate("t", "m")
    assert estimate is not None and estimate.p50_tokens == 1

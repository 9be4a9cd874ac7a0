from __future__ import annotations

import numpy as np
import pytest

from predictor.config import LengthSettings
from predictor.prior import OutputLengthEstimator


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


def test_drift_correction_follows_a_shift_the_histogram_lags_and_lowers_the_error() -> None:
    estimator = OutputLengthEstimator(LengthSettings(half_life_samples=500, min_samples=5, drift_rate=0.1))
    for _ in range(400):
        estimator.observe("t", "m", 100, estimator.predict("t", "m"))
    assert estimator.drift_factor("t", "m") == pytest.approx(1.0, abs=0.1)
    before = estimator.accuracy.status()  # the first few borrowed the default (256): raw erred more
    assert before["mae_corrected_tokens"] <= before["mae_raw_tokens"]  # type: ignore[operator]
    for _ in range(100):  # the tenant's outputs quadruple; the slow histogram still answers ~100
        estimator.observe("t", "m", 400, estimator.predict("t", "m"))
    prediction = estimator.predict("t", "m")
    assert prediction.raw_tokens < 250 < prediction.tokens <= 450
    after = estimator.accuracy.status()
    assert after["mae_corrected_tokens"] < after["mae_raw_tokens"]  # type: ignore[operator]


def test_drift_is_not_learnt_from_completions_cut_by_their_own_limit() -> None:
    estimator = OutputLengthEstimator(LengthSettings(min_samples=1, drift_rate=0.5))
    for _ in range(200):
        estimator.observe("t", "m", 300)
    for _ in range(20):
        estimator.observe("t", "m", 20, estimator.predict("t", "m", max_tokens=20))  # stopped at max_tokens
    assert estimator.drift_factor("t", "m") == 1.0
    capped = estimator.predict("t", "m", max_tokens=20)
    assert capped.raw_tokens == capped.tokens == 20


def test_drift_factor_is_bounded_and_off_at_rate_zero() -> None:
    bounded = OutputLengthEstimator(LengthSettings(min_samples=1, drift_rate=1.0, drift_max_factor=4.0))
    bounded.observe("t", "m", 10)
    bounded.observe("t", "m", 100_000, bounded.predict("t", "m"))
    assert bounded.drift_factor("t", "m") == pytest.approx(4.0)
    off = OutputLengthEstimator(LengthSettings(min_samples=1, drift_rate=0.0))
    off.observe("t", "m", 10)
    off.observe("t", "m", 1000, off.predict("t", "m"))
    assert off.drift_factor("t", "m") == 1.0


def test_repeated_predictions_follow_every_observation() -> None:
    """Estimates and predictions are kept between observations: each observation must still show,
    exactly as a fresh estimator fed the same completions answers."""
    settings = LengthSettings(min_samples=3, half_life_samples=50)
    kept = OutputLengthEstimator(settings)
    rng = np.random.default_rng(1)
    seen: list[int] = []
    for n in rng.lognormal(mean=4.0, sigma=1.0, size=120).astype(int):
        for max_tokens in (None, 64):
            made = kept.predict("acme", "llama", max_tokens)
            assert kept.predict("acme", "llama", max_tokens) == made
        fresh = OutputLengthEstimator(settings)
        for old in seen:
            fresh.observe("acme", "llama", old)
        assert kept.estimate("acme", "llama") == fresh.estimate("acme", "llama")
        assert kept.predict("acme", "llama") == fresh.predict("acme", "llama")
        histogram = kept._keys.get(("acme", "llama"))
        if histogram is not None:  # one cumulative sum for both quantiles: the same as one each
            estimate = histogram.estimate()
            assert (estimate.p50_tokens, estimate.p90_tokens) == (histogram.quantile(0.5), histogram.quantile(0.9))
        kept.observe("acme", "llama", int(n))
        seen.append(int(n))


def test_predictions_kept_are_bounded_by_client_max_tokens() -> None:
    estimator = OutputLengthEstimator(LengthSettings())
    for max_tokens in range(1, 2000):
        assert estimator.predict("acme", "llama", max_tokens).tokens <= max_tokens
    assert len(estimator._predicted) <= 256

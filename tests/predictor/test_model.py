from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from predictor.config import XGBoostSettings
from predictor.features import Feature, Quantity, Samples, Target, build_features, mape_pct, p90_coverage
from predictor.model import SLOT_OF, PoolModel, predict_ms, train_target, usable
from tests.predictor.synthetic import TPOT_NOISE_SIGMA, TTFT_NOISE_SIGMA, endpoint, prior, samples

XGB = XGBoostSettings()


@pytest.fixture(scope="module")
def data() -> tuple[Samples, Samples, Samples]:
    rng = np.random.default_rng(7)
    return samples(3000, rng), samples(400, rng), samples(1000, rng)


def test_too_few_samples_means_no_model(data: tuple[Samples, Samples, Samples]) -> None:
    train, heldout, _ = data
    assert train_target(train, heldout, Target.TTFT, XGB, min_samples=5000, conformal_p90=True) is None


@pytest.mark.slow
def test_models_learn_what_the_prior_misses(data: tuple[Samples, Samples, Samples]) -> None:
    train, heldout, test = data
    for target, actual, sigma in (
        (Target.TTFT, test.ttft_ms, TTFT_NOISE_SIGMA),
        (Target.TPOT, test.tpot_ms, TPOT_NOISE_SIGMA),
    ):
        model = train_target(train, heldout, target, XGB, min_samples=100, conformal_p90=True)
        assert model is not None and model.train_samples == 3000
        mean_ms, p90_ms = predict_ms(model, test.rows)
        prior_ms = test.rows[:, Feature.PRIOR_TTFT_MS if target is Target.TTFT else Feature.PRIOR_TPOT_MS]
        model_mape, prior_mape = mape_pct(mean_ms, actual), mape_pct(prior_ms, actual)
        noise_floor = 100 * sigma * np.sqrt(2 / np.pi)  # E|exp(e)-1| ~ E|e| for log-normal noise
        assert model_mape < prior_mape / 2
        assert model_mape < 1.5 * noise_floor
        assert 0.8 <= p90_coverage(p90_ms, actual) <= 0.97
        assert (p90_ms >= mean_ms).all()
        assert model.heldout is not None and model.heldout.samples == 400
        assert model.prior_heldout is not None and model.prior_heldout.mape_pct > model.heldout.mape_pct


def test_training_keeps_its_heldout_predictions_for_the_judge(data: tuple[Samples, Samples, Samples]) -> None:
    """The judge compares held-out errors from what training predicted, not from a second pass."""
    train, heldout, _ = data
    model = train_target(train, heldout, Target.TPOT, XGB, min_samples=100, conformal_p90=True)
    assert model is not None and model.heldout_mean_ms is not None
    rows, _ = usable(heldout, Target.TPOT)
    np.testing.assert_allclose(model.heldout_mean_ms, predict_ms(model, rows)[0])


def test_log_ratio_target_extrapolates_with_the_prior(data: tuple[Samples, Samples, Samples]) -> None:
    """Prompts 10x longer than any trained on: the prior scales, the correction stays bounded."""
    train, heldout, test = data
    model = train_target(train, heldout, Target.TTFT, XGB, min_samples=100, conformal_p90=False)
    assert model is not None
    longer = test.rows.copy()
    longer[:, Feature.PRIOR_TTFT_MS] *= 10
    mean_short, _ = predict_ms(model, test.rows)
    mean_long, _ = predict_ms(model, longer)
    ratio = mean_long / mean_short
    assert np.median(ratio) == pytest.approx(10, rel=0.25)


@pytest.mark.slow
def test_conformal_offset_calibrates_the_p90(data: tuple[Samples, Samples, Samples]) -> None:
    train, heldout, test = data
    raw = train_target(train, heldout, Target.TTFT, XGB, min_samples=100, conformal_p90=False)
    calibrated = train_target(train, heldout, Target.TTFT, XGB, min_samples=100, conformal_p90=True)
    assert raw is not None and calibrated is not None
    assert raw.p90_offset == 0.0 and calibrated.p90_offset != 0.0
    coverage = p90_coverage(predict_ms(calibrated, test.rows)[1], test.ttft_ms)
    assert abs(coverage - 0.9) <= abs(p90_coverage(predict_ms(raw, test.rows)[1], test.ttft_ms) - 0.9) + 0.02


@pytest.mark.slow
def test_pool_model_evaluates_all_targets_in_one_forest(data: tuple[Samples, Samples, Samples]) -> None:
    train, heldout, test = data
    models = {t: train_target(train, heldout, t, XGB, 100, True) for t in Target}
    pool_model = PoolModel.assemble(3, {t: m for t, m in models.items() if m is not None})
    assert pool_model.version == 3 and pool_model.forest.num_outputs == 4
    latency = pool_model.latency_ms(test.rows[:8])
    for target, model in models.items():
        assert model is not None
        mean_ms, p90_ms = predict_ms(model, test.rows[:8])
        slots = list(pool_model.slots)
        np.testing.assert_allclose(latency[:, slots.index(SLOT_OF[target, Quantity.MEAN])], mean_ms, rtol=1e-5)
        np.testing.assert_allclose(latency[:, slots.index(SLOT_OF[target, Quantity.P90])], p90_ms, rtol=1e-5)
    tpot_model = models[Target.TPOT]
    assert tpot_model is not None
    only_tpot = PoolModel.assemble(1, {Target.TPOT: tpot_model})
    assert list(only_tpot.slots) == [SLOT_OF[Target.TPOT, Quantity.MEAN], SLOT_OF[Target.TPOT, Quantity.P90]]


def test_rows_without_a_target_are_skipped() -> None:
    rng = np.random.default_rng(3)
    data = samples(400, rng)
    tpot = data.tpot_ms.copy()
    tpot[::2] = np.nan  # single-token completions have no TPOT
    partial = Samples(data.rows, data.ttft_ms, tpot)
    model = train_target(partial, partial, Target.TPOT, XGB, min_samples=150, conformal_p90=False)
    assert model is not None and model.train_samples == 200


def test_the_p90_is_never_under_the_mean_times_its_floor(data: tuple[Samples, Samples, Samples]) -> None:
    """A quantile model that collapses (here: shifted far down) leaves the p90 at the floor, the point
    model's own conformal p90, which still covers about 90 % of outcomes."""
    train, heldout, test = data
    model = train_target(train, heldout, Target.TTFT, XGB, min_samples=100, conformal_p90=True)
    assert model is not None and model.p90_floor > 0
    collapsed = replace(model, p90_offset=-5.0)
    mean_ms, p90_ms = predict_ms(collapsed, test.rows)
    np.testing.assert_allclose(p90_ms, mean_ms * np.exp(model.p90_floor), rtol=1e-9)
    assert 0.85 <= p90_coverage(p90_ms, test.ttft_ms) <= 0.95
    pool = PoolModel.assemble(1, {Target.TTFT: collapsed})
    np.testing.assert_allclose(pool.latency_ms(test.rows[:8])[:, 1], p90_ms[:8], rtol=1e-5)


def test_without_calibration_the_p90_is_at_least_the_mean(data: tuple[Samples, Samples, Samples]) -> None:
    train, heldout, test = data
    model = train_target(train, heldout, Target.TPOT, XGB, min_samples=100, conformal_p90=False)
    assert model is not None and model.p90_floor == 0.0
    mean_ms, p90_ms = predict_ms(replace(model, p90_offset=-5.0), test.rows)
    np.testing.assert_array_equal(p90_ms, mean_ms)


@pytest.mark.slow
def test_the_ttft_model_learns_that_a_lower_tier_hit_is_slower_than_an_hbm_one() -> None:
    """The cached tokens per tier reach the model: in a world where loading from DRAM costs time the
    prior does not see (it counts every cached token alike), the trees learn the split."""
    rng = np.random.default_rng(11)
    latency_prior = prior()

    def world(n: int) -> Samples:
        rows = []
        for _ in range(n):
            inputs = int(rng.integers(2000, 6000))
            cached = int(rng.integers(0, inputs))
            lower = int(rng.integers(0, cached + 1)) if rng.random() < 0.5 else 0
            rows.append(
                build_features(inputs, 50, [endpoint(0)], [cached], latency_prior, lower_cached_tokens=[lower])[0]
            )
        m = np.stack(rows)
        ttft = m[:, Feature.PRIOR_TTFT_MS] * (1 + 2.0 * m[:, Feature.CACHED_LOWER_TOKENS] / m[:, Feature.INPUT_TOKENS])
        return Samples(m, ttft.astype(np.float64), m[:, Feature.PRIOR_TPOT_MS].astype(np.float64))

    model = train_target(world(2000), world(300), Target.TTFT, XGB, min_samples=100, conformal_p90=False)
    assert model is not None
    hbm = build_features(4000, 50, [endpoint(0)], [3000], latency_prior, lower_cached_tokens=[0])
    dram = build_features(4000, 50, [endpoint(0)], [3000], latency_prior, lower_cached_tokens=[3000])
    assert hbm[0, Feature.PRIOR_TTFT_MS] == dram[0, Feature.PRIOR_TTFT_MS]  # the prior cannot tell them apart
    (hbm_ms,), _ = predict_ms(model, hbm)
    (dram_ms,), _ = predict_ms(model, dram)
    assert dram_ms > 1.5 * hbm_ms  # the truth: 2.5x

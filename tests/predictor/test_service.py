from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from predictor.config import PriorSettings
from predictor.features import Feature, Prediction, RequestShape, Target
from predictor.model import TrainingWorker, TrainJob, TrainOutcome
from predictor.service import LatencyPredictor
from tests.predictor.synthetic import (
    POOL,
    endpoint,
    pool_config,
    random_cached,
    random_endpoint,
    random_request,
    settings,
    truth,
)
from tests.support.polling import wait_for_async

CANDIDATES = [
    endpoint(0),
    endpoint(1, running=40, kv=0.6, decode_tokens=40 * 1500),
    endpoint(2, running=60, waiting=6, kv=0.95, prefill_tokens=12_000, decode_tokens=60 * 2000),
]


def _predictor(**overrides: object) -> LatencyPredictor:
    return LatencyPredictor(settings(**overrides), {POOL: pool_config()})


def _serve(predictor: LatencyPredictor, n: int, rng: np.random.Generator, start: int = 0, scale: float = 1.0) -> None:
    """`n` requests: predict on random candidates, run on the first, observe the outcome (`scale`
    multiplies the synthetic world's latencies)."""
    for _i in range(start, start + n):
        request = random_request(rng)
        candidates = [random_endpoint(rng, k) for k in range(3)]
        predictions = predictor.predict(POOL, request, candidates, [random_cached(rng, request) for _ in candidates])
        chosen = predictions[0]
        ttft_ms, tpot_ms = truth(chosen.features, rng)
        predictor.observe(POOL, chosen.features, ttft_ms * scale, tpot_ms * scale, chosen)


def test_prior_predicts_before_any_model() -> None:
    predictor = _predictor()
    request = RequestShape(input_tokens=3000, output_tokens=200)
    predictions = predictor.predict(POOL, request, CANDIDATES, [2048, 0, 0])
    assert [p.endpoint_id for p in predictions] == [e.id for e in CANDIDATES]
    for p in predictions:
        assert (p.ttft_source, p.tpot_source, p.model_version) == ("prior", "prior", 0)
        assert p.ttft_ms == pytest.approx(float(p.features[Feature.PRIOR_TTFT_MS]))
        assert p.ttft_p90_ms == pytest.approx(1.5 * p.ttft_ms)
        assert p.tpot_p90_ms == pytest.approx(1.2 * p.tpot_ms)
    idle, busy, overloaded = predictions
    assert idle.ttft_ms < busy.ttft_ms < overloaded.ttft_ms
    assert idle.tpot_ms < busy.tpot_ms
    assert predictor.predict(POOL, request, [], []) == []


@pytest.mark.parametrize("worker", ["thread", pytest.param("process", marks=pytest.mark.e2e)])
@pytest.mark.slow
async def test_training_runs_off_loop_then_the_model_is_swapped_in(worker: str) -> None:
    predictor = _predictor(worker=worker)
    rng = np.random.default_rng(21)
    request = RequestShape(input_tokens=3000, output_tokens=200)
    before = predictor.predict(POOL, request, CANDIDATES, [2048, 0, 0])
    ticks_while_training = 0
    stop = asyncio.Event()

    async def heartbeat() -> None:
        nonlocal ticks_while_training
        while not stop.is_set():
            await asyncio.sleep(0)
            if predictor.status()["pools"][POOL]["training"]:
                ticks_while_training += 1

    await predictor.start()
    beat = asyncio.create_task(heartbeat())
    try:
        _serve(predictor, 1200, rng)  # past min_samples and retrain_min_new_samples: wakes the trainer
        await wait_for_async(lambda: predictor.status()["pools"][POOL]["model_version"] >= 1)
    finally:
        stop.set()
        await beat
        await predictor.stop()
    assert ticks_while_training > 0  # the loop kept running while the model trained
    after = predictor.predict(POOL, request, CANDIDATES, [2048, 0, 0])
    version = predictor.status()["pools"][POOL]["model_version"]
    assert version > 0 and all(p.source == "model" and p.model_version == version for p in after)
    assert [p.ttft_ms for p in after] != [p.ttft_ms for p in before]
    # the synthetic world is slower than the prior under KV pressure: the model learnt that
    assert after[2].ttft_ms > before[2].ttft_ms
    status = predictor.status()["pools"][POOL]
    assert status["targets"]["ttft"]["source"] == "model"
    assert status["targets"]["ttft"]["model_age_s"] >= 0
    assert status["last_training"]["decisions"] == {"ttft": "trained", "tpot": "trained"}


@pytest.mark.slow
async def test_model_predictions_beat_the_prior_online() -> None:
    predictor = _predictor(accuracy_window=5000)
    rng = np.random.default_rng(3)
    await predictor.start()
    try:
        _serve(predictor, 1500, rng)
        await wait_for_async(lambda: predictor.status()["pools"][POOL]["model_version"] >= 1)
        _serve(predictor, 1500, rng, start=1500)
    finally:
        await predictor.stop()
    targets = predictor.status()["pools"][POOL]["targets"]
    for name in ("ttft", "tpot"):
        model, prior = targets[name]["online_model"], targets[name]["online_prior"]
        assert model["samples"] > 500 and prior["samples"] > 0
        assert model["mape_pct"] < prior["mape_pct"] / 2
        assert 0.8 <= model["p90_coverage"] <= 0.97


@pytest.mark.slow
async def test_saved_model_is_loaded_at_restart(tmp_path: Path) -> None:
    # the online p90 correction is runtime state, not part of a saved model: off here
    first = _predictor(model_dir=tmp_path, online_training=False, advanced={"p90_adaptation_rate": 0})
    await first.start()
    _serve(first, 800, np.random.default_rng(8))
    outcome = await first.retrain(POOL)
    assert outcome is not None and outcome.model is not None
    await first.stop()
    request = RequestShape(input_tokens=1500, output_tokens=64)
    expected = first.predict(POOL, request, CANDIDATES, [0, 0, 0])

    second = _predictor(model_dir=tmp_path, online_training=False, advanced={"p90_adaptation_rate": 0})
    assert second.predict(POOL, request, CANDIDATES, [0, 0, 0])[0].source == "prior"
    await second.start()
    loaded = second.predict(POOL, request, CANDIDATES, [0, 0, 0])
    await second.stop()
    assert [p.ttft_ms for p in loaded] == [p.ttft_ms for p in expected]
    assert [p.tpot_p90_ms for p in loaded] == [p.tpot_p90_ms for p in expected]
    assert loaded[0].model_version == expected[0].model_version == 1


@pytest.mark.slow
async def test_versions_continue_after_restart(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    for expected_version, world_scale in ((1, 1.0), (2, 0.5)):  # the world changed: v1 is now wrong
        predictor = _predictor(model_dir=tmp_path, online_training=False)
        await predictor.start()
        _serve(predictor, 600, rng, scale=world_scale)
        outcome = await predictor.retrain(POOL)
        await predictor.stop()
        assert outcome is not None and outcome.model is not None
        assert outcome.model.version == expected_version
    assert sorted(p.name for p in (tmp_path / POOL).iterdir()) == ["samples.npz", "v000001", "v000002"]


@pytest.mark.slow
async def test_samples_survive_a_restart_and_the_next_model_trains_on_them(tmp_path: Path) -> None:
    first = _predictor(model_dir=tmp_path, online_training=False)
    await first.start()
    _serve(first, 600, np.random.default_rng(10))
    assert await first.retrain(POOL) is not None
    _serve(first, 50, np.random.default_rng(11))  # observed after the last model: saved at stop
    await first.stop()
    kept = first.status()["pools"][POOL]["buffer"]

    second = _predictor(model_dir=tmp_path, online_training=False)
    await second.start()
    restored = second.status()["pools"][POOL]["buffer"]
    assert (restored["train_samples"], restored["heldout_samples"]) == (kept["train_samples"], kept["heldout_samples"])
    assert restored["train_samples"] + restored["heldout_samples"] == 650
    _serve(second, 30, np.random.default_rng(12))
    outcome = await second.retrain(POOL)
    await second.stop()
    assert outcome is not None and outcome.model is not None
    assert outcome.model.targets[Target.TTFT].train_samples > 550  # not just the 30 new ones

    saved = tmp_path / POOL / "samples.npz"
    before = saved.stat().st_mtime_ns
    idle = _predictor(model_dir=tmp_path, online_training=False)
    await idle.start()
    await idle.stop()  # nothing new since they were restored: not written again
    assert saved.stat().st_mtime_ns == before


async def test_a_failing_training_is_reported_not_raised() -> None:
    class Broken(TrainingWorker):
        async def run(self, job: TrainJob) -> TrainOutcome:
            raise RuntimeError("out of memory")

    predictor = LatencyPredictor(settings(), {POOL: pool_config()}, worker=Broken("thread"))
    await predictor.start()
    _serve(predictor, 300, np.random.default_rng(1))
    assert await predictor.retrain(POOL) is None
    await predictor.stop()
    status = predictor.status()["pools"][POOL]
    assert status["last_error"] == "RuntimeError: out of memory"
    assert status["model_version"] == 0


def test_observe_scores_predictions_and_counts_samples() -> None:
    predictor = _predictor()
    request = RequestShape(input_tokens=1000, output_tokens=50)
    prediction = predictor.predict(POOL, request, CANDIDATES[:1], [0])[0]
    predictor.observe(POOL, prediction.features, prediction.ttft_ms * 1.1, None, prediction)
    predictor.observe(POOL, prediction.features, None, None, prediction)  # nothing observed
    status = predictor.status()["pools"][POOL]
    ttft, tpot = status["targets"]["ttft"], status["targets"]["tpot"]
    assert ttft["online"]["samples"] == 1
    assert ttft["online"]["mape_pct"] == pytest.approx(100 * 0.1 / 1.1, rel=1e-4)
    assert ttft["online"]["p90_coverage"] == 1.0
    assert tpot["online"]["samples"] == 0
    assert ttft["samples"] == 1 and tpot["samples"] == 0
    assert status["buffer"]["train_samples"] + status["buffer"]["heldout_samples"] == 1
    with pytest.raises(ValueError, match="feature row"):
        predictor.observe(POOL, np.zeros(3, dtype=np.float32), 1.0, 1.0)


@pytest.mark.slow
def test_p90_adapts_online_to_a_world_the_prior_misjudges() -> None:
    """Everything is 3x slower than the prior thinks: its fixed 1.5x p90 would cover nothing."""
    predictor = _predictor(advanced={"p90_adaptation_rate": 0.02})
    rng = np.random.default_rng(4)
    covered: list[bool] = []
    for _i in range(3000):
        request = random_request(rng)
        chosen = predictor.predict(POOL, request, [random_endpoint(rng)], [0])[0]
        ttft_ms, tpot_ms = truth(chosen.features, rng)
        covered.append(3 * ttft_ms <= chosen.ttft_p90_ms)
        predictor.observe(POOL, chosen.features, 3 * ttft_ms, 3 * tpot_ms, chosen)
    assert sum(covered[:20]) <= 2
    assert 0.8 <= sum(covered[-1000:]) / 1000 <= 0.97
    status = predictor.status()["pools"][POOL]["targets"]
    assert status["ttft"]["p90_online_shift"] > 0.5  # log-space: the p90 grew by more than e**0.5


def test_output_length_estimate_replaces_missing_max_tokens() -> None:
    predictor = _predictor()
    no_max = RequestShape(input_tokens=1000, output_tokens=None, tenant="acme", model="m")
    default = predictor.predict(POOL, no_max, CANDIDATES[:1], [0])[0]
    assert default.features[Feature.OUTPUT_TOKENS] == 256  # length.default_output_tokens
    assert predictor.output_tokens_estimate("acme", "m") is None
    for _ in range(50):
        predictor.observe_output("acme", "m", 40)
    estimate = predictor.output_tokens_estimate("acme", "m")
    assert estimate is not None and estimate.p90_tokens == pytest.approx(40, rel=0.1)
    learnt = predictor.predict(POOL, no_max, CANDIDATES[:1], [0])[0]
    assert learnt.features[Feature.OUTPUT_TOKENS] == pytest.approx(40, rel=0.1)


def test_unknown_pool_gets_the_default_prior() -> None:
    predictor = _predictor()
    predictions = predictor.predict("elsewhere", RequestShape(100, 10), [endpoint(0, pool="elsewhere")], [0])
    assert predictions[0].source == "prior" and predictions[0].ttft_ms > 0
    assert "elsewhere" in predictor.status()["pools"]


def test_prediction_accessors() -> None:
    p = _predictor().predict(POOL, RequestShape(100, 10), CANDIDATES[:1], [0])[0]
    assert isinstance(p, Prediction)
    assert (p.mean_ms(Target.TTFT), p.p90_ms(Target.TPOT)) == (p.ttft_ms, p.tpot_p90_ms)
    assert p.source_of(Target.TPOT) == "prior"


def test_recent_outcomes_are_exported_in_order_and_bounded() -> None:
    predictor = _predictor(export_samples=5)
    _serve(predictor, 8, np.random.default_rng(4))
    outcomes = predictor.samples()[POOL]
    assert len(outcomes) == 5  # the oldest three dropped
    assert [o["observed_at_s"] for o in outcomes] == sorted(o["observed_at_s"] for o in outcomes)
    for o in outcomes:
        assert o["predicted_at_s"] <= o["observed_at_s"]
        assert set(o["features"]) == {f.name.lower() for f in Feature}
        assert o["ttft_ms"] > 0 and o["predicted"]["ttft_ms"] > 0 and o["endpoint"]
    assert predictor.samples("no-such-pool") == {}
    assert _predictor(export_samples=0).samples() == {POOL: []}


def test_first_tokens_correct_the_next_ttft_predictions_of_the_pool() -> None:
    """TTFTs twice what was predicted, relayed in the last (engine) second: the pool's TTFT
    predictions grow by exp(0.5 x ln 2); TPOT is untouched; the residual is taken against the
    uncorrected prediction, so the correction does not compound."""
    predictor = _predictor(
        advanced={"recent_ttft_window_s": 1.0, "recent_ttft_weight": 0.5}, prior=PriorSettings(time_scale=0.25)
    )
    request = RequestShape(input_tokens=1000, output_tokens=50)
    before = predictor.predict(POOL, request, CANDIDATES, [0, 0, 0], now_s=10.0)
    assert all(p.ttft_factor == 1.0 for p in before)
    for at_s in (10.1, 10.2, 10.3):
        predictor.observe_first_token(POOL, before[0], 2 * before[0].ttft_ms, now_s=at_s)
    after = predictor.predict(POOL, request, CANDIDATES, [0, 0, 0], now_s=10.4)
    for old, new in zip(before, after, strict=True):
        assert new.ttft_factor == pytest.approx(math.sqrt(2))
        assert new.ttft_ms == pytest.approx(old.ttft_ms * math.sqrt(2))
        assert new.ttft_p90_ms == pytest.approx(old.ttft_p90_ms * math.sqrt(2))
        assert (new.tpot_ms, new.tpot_p90_ms) == (old.tpot_ms, old.tpot_p90_ms)
    predictor.observe_first_token(POOL, after[0], 2 * before[0].ttft_ms, now_s=10.5)  # same error, corrected
    assert predictor.predict(POOL, request, CANDIDATES, [0, 0, 0], now_s=10.6)[0].ttft_factor == pytest.approx(
        math.sqrt(2)
    )
    # one engine second is four wall seconds at time scale 0.25: still corrected at 14.0, not at 15.0
    assert predictor.predict(POOL, request, CANDIDATES, [0, 0, 0], now_s=14.0)[0].ttft_factor != 1.0
    assert predictor.predict(POOL, request, CANDIDATES, [0, 0, 0], now_s=15.0)[0].ttft_factor == 1.0
    status = predictor.status()["pools"][POOL]
    assert status["ttft_recent_factor"] == 1.0

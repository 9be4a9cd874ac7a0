"""Token velocity at the SLO from the roofline capacity model, and its measured calibration."""

from __future__ import annotations

import pytest

from backends.config import PoolConfig
from predictor.config import PriorSettings
from predictor.prior import Calibration, LatencyPrior, Mix, replica_velocity


def prior(preset: str = "llama-3.1-8b@h100", time_scale: float = 1.0) -> LatencyPrior:
    pool = PoolConfig(name="p", model="m", preset=preset, replicas=1)
    return LatencyPrior.for_pool(pool, PriorSettings(time_scale=time_scale))


MIX = Mix(prompt_tokens=1155, output_tokens=211)


def test_a_looser_tpot_objective_carries_more_tokens() -> None:
    tight = replica_velocity(prior(), MIX, ttft_slo_ms=1000, tpot_slo_ms=20)
    loose = replica_velocity(prior(), MIX, ttft_slo_ms=1000, tpot_slo_ms=40)
    assert 0 < tight.decode_tps < loose.decode_tps
    assert tight.limit == "tpot"
    assert tight.prefill_tps / tight.decode_tps == pytest.approx(1155 / 211)


def test_the_velocity_keeps_the_objective_it_was_computed_for() -> None:
    p = prior()
    v = replica_velocity(p, MIX, ttft_slo_ms=1000, tpot_slo_ms=30)
    step_ms = p.steady_step_s(v.batch, v.batch * (1155 + 211 / 2), v.requests_per_s * 1155, 1155) * 1e3
    assert step_ms <= 30.0 * 1.02  # within the fixed point's tolerance
    assert v.batch == pytest.approx(v.requests_per_s * 211 * step_ms / 1e3, rel=0.02)  # Little's law


def test_roles() -> None:
    p = prior()
    prefill = replica_velocity(p, MIX, ttft_slo_ms=500, tpot_slo_ms=30, role="prefill")
    decode = replica_velocity(p, MIX, ttft_slo_ms=500, tpot_slo_ms=30, role="decode")
    both = replica_velocity(p, MIX, ttft_slo_ms=500, tpot_slo_ms=30)
    assert prefill.limit == "ttft" and prefill.batch == 0
    assert decode.prefill_tps == 0 and decode.limit in ("tpot", "seqs")
    assert decode.decode_tps > both.decode_tps  # a decoder never pays for prefill chunks
    assert prefill.prefill_tps > both.prefill_tps


def test_kv_capacity_bounds_the_batch() -> None:
    v = replica_velocity(prior(), MIX, ttft_slo_ms=5000, tpot_slo_ms=60, kv_tokens=20_000, role="decode")
    assert v.limit == "kv"
    assert v.batch * (1155 + 211 / 2) == pytest.approx(20_000, rel=0.02)


def test_time_scale_and_factor_scale_wall_clock_velocity() -> None:
    real = replica_velocity(prior(), MIX, ttft_slo_ms=1000, tpot_slo_ms=30)
    fast = replica_velocity(prior(time_scale=10), MIX, ttft_slo_ms=100, tpot_slo_ms=3)
    assert fast.decode_tps == pytest.approx(10 * real.decode_tps, rel=0.01)
    slower = replica_velocity(prior(), MIX, ttft_slo_ms=1000, tpot_slo_ms=30, factor=0.5)
    assert slower.decode_tps == pytest.approx(0.5 * real.decode_tps)


def test_an_objective_below_one_step_has_no_velocity() -> None:
    v = replica_velocity(prior("opt-13b@a100"), MIX, ttft_slo_ms=1000, tpot_slo_ms=5)
    assert v.requests_per_s == 0 and v.limit == "tpot"


def test_calibration_is_the_median_ratio_of_model_to_measured() -> None:
    p = prior()
    calibration = Calibration(min_samples=3)
    modelled_ms = p.steady_step_s(8, 8 * 1200, 0.0, 0.0) * 1e3
    for _ in range(2):
        calibration.observe(p, 2 * modelled_ms, batch=8, context_tokens=8 * 1200)
    assert calibration.factor == 1.0  # too few samples
    calibration.observe(p, 2 * modelled_ms, batch=8, context_tokens=8 * 1200)
    assert calibration.factor == pytest.approx(0.5)
    calibration.observe(p, modelled_ms / 100, batch=8, context_tokens=8 * 1200)  # an outlier, clamped out
    assert calibration.factor == pytest.approx(0.5)

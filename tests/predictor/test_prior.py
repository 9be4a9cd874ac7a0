from __future__ import annotations

import numpy as np
import pytest

from backends.perf.presets import DEFAULT_PRESET, resolve_preset
from backends.perf.roofline import batch_defaults, decode_step_time_s, prefill_time_s, step_time_s
from predictor.config import PriorSettings
from predictor.prior import LatencyPrior, Roofline
from tests.predictor.synthetic import pool_config


@pytest.mark.parametrize("preset_name", ["llama-3.1-8b@h100", "llama-3.1-70b-tp4@h100", "qwen2.5-7b@a100"])
def test_roofline_coefficients_reproduce_the_sim_step_time(preset_name: str) -> None:
    preset = resolve_preset(preset_name)
    roof = Roofline.from_preset(preset)
    rng = np.random.default_rng(0)
    for _ in range(50):
        chunks = [(int(rng.integers(1, 4000)), int(rng.integers(0, 8000))) for _ in range(rng.integers(0, 3))]
        decodes = [int(c) for c in rng.integers(0, 10000, size=rng.integers(0, 64))]
        if not chunks and not decodes:
            continue
        tokens = sum(n for n, _ in chunks) + len(decodes)
        pairs = sum(n * (ctx + (n + 1) / 2) for n, ctx in chunks) + sum(decodes) + len(decodes)
        kv_read = sum(ctx for _, ctx in chunks) + sum(decodes)
        ours = roof.step_s(tokens, len(chunks) + len(decodes), pairs, kv_read, bool(chunks))
        assert ours == pytest.approx(step_time_s(preset, chunks, decodes), rel=1e-9)


def test_idle_endpoint_prior_is_the_frontend_one_prefill_and_one_decode_step() -> None:
    preset = resolve_preset("llama-3.1-8b@h100")
    prior = LatencyPrior.for_pool(pool_config(), PriorSettings())
    est = prior.estimate(
        2000, 500, 100, running=0, waiting=0, inflight_requests=0, inflight_prefill_tokens=0, inflight_decode_tokens=0
    )
    assert est.prefill_steps == 1
    frontend = preset.efficiency.frontend_s
    assert frontend > 0
    assert est.ttft_ms == pytest.approx((frontend + prefill_time_s(preset, 2000, 500)) * 1e3, rel=1e-9)
    assert est.tpot_ms == pytest.approx(decode_step_time_s(preset, 1, 2000 + 50) * 1e3, rel=1e-9)


def _ttft(prior: LatencyPrior, **load: float) -> float:
    args = {
        "input_tokens": 3000.0,
        "cached_tokens": 0.0,
        "output_tokens": 200.0,
        "running": 0.0,
        "waiting": 0.0,
        "inflight_requests": 0.0,
        "inflight_prefill_tokens": 0.0,
        "inflight_decode_tokens": 0.0,
    } | load
    return prior.estimate(**args).ttft_ms


def test_ttft_grows_with_work_ahead_and_shrinks_with_cache_hits() -> None:
    prior = LatencyPrior.for_pool(pool_config(), PriorSettings())
    idle = _ttft(prior)
    assert _ttft(prior, inflight_prefill_tokens=20_000, waiting=4, inflight_requests=4) > 2 * idle
    assert _ttft(prior, cached_tokens=2500) < idle
    assert _ttft(prior, running=40, inflight_requests=40, inflight_decode_tokens=60_000) > idle
    # a full batch: the request waits for a slot
    seqs = prior.max_num_seqs
    full = {"running": seqs, "inflight_requests": seqs + 50, "waiting": 50, "inflight_decode_tokens": seqs * 1500}
    not_full = full | {"waiting": 0, "inflight_requests": seqs - 50, "running": seqs - 50}
    assert _ttft(prior, **full) > 3 * _ttft(prior, **not_full)


def test_arriving_prompts_slow_the_decode_steps() -> None:
    prior = LatencyPrior.for_pool(pool_config(), PriorSettings())

    def tpot(rate_tps: float) -> float:
        return prior.estimate(1000, 0, 100, 32, 0, 32, 0, 32 * 1500, rate_tps).tpot_ms

    calm, busy, saturated = tpot(0), tpot(20_000), tpot(1e9)
    assert calm < busy < saturated
    # saturated: every step fills its token budget with prompts like this one (1000 tokens)
    preset = resolve_preset("llama-3.1-8b@h100")
    budget = prior.max_num_batched_tokens - 33
    prompts = [(1000, 0)] * (budget // 1000) + [(budget % 1000, 0)]
    assert saturated == pytest.approx(step_time_s(preset, prompts, [1500] * 32 + [1050]) * 1e3, rel=0.02)


def test_tpot_grows_with_batch_and_context() -> None:
    prior = LatencyPrior.for_pool(pool_config(), PriorSettings())

    def tpot(running: int, decode_tokens: int) -> float:
        return prior.estimate(1000, 0, 100, running, 0, running, 0, decode_tokens).tpot_ms

    assert tpot(0, 0) < tpot(64, 64 * 1000) < tpot(64, 64 * 8000)
    assert tpot(64, 64 * 1000) < tpot(200, 200 * 1000)


def test_pool_limits_and_preset_shape_the_prior() -> None:
    settings = PriorSettings()
    small = LatencyPrior.for_pool(pool_config(), settings)
    big = LatencyPrior.for_pool(pool_config(preset="llama-3.1-70b-tp4@h100"), settings)  # 70B does not fit one H100
    assert _ttft(big) > _ttft(small)
    assert small.id != big.id
    default = LatencyPrior.for_pool(pool_config(preset=None), settings)
    assert default.preset_name == DEFAULT_PRESET
    # engine limits default to vLLM's by device memory, as the simulated engine applies them
    assert (small.max_num_seqs, small.max_num_batched_tokens) == batch_defaults(resolve_preset("llama-3.1-8b@h100"))
    a100 = LatencyPrior.for_pool(pool_config(preset="qwen2.5-7b@a100"), settings)
    assert (a100.max_num_seqs, a100.max_num_batched_tokens) == (256, 2048)
    overridden = LatencyPrior.for_pool(pool_config(), PriorSettings(max_num_seqs=64))
    assert overridden.max_num_seqs == 64
    limited = LatencyPrior.for_pool(
        pool_config().model_copy(update={"max_num_batched_tokens": 512, "max_num_seqs": 8}), settings
    )
    assert (limited.max_num_batched_tokens, limited.max_num_seqs) == (512, 8)
    assert limited.estimate(3000, 0, 100, 0, 0, 0, 0, 0).prefill_steps == 6


def test_a_time_scaled_engine_is_predicted_in_wall_time() -> None:
    """A simulated engine at `--time-scale 4` runs 4x faster than real: the prior's wall-clock inputs
    (prefill rate, time since the last token) convert to engine time and its latencies back."""
    real = LatencyPrior.for_pool(pool_config(), PriorSettings())
    fast = LatencyPrior.for_pool(pool_config(), PriorSettings(time_scale=4.0))
    assert fast.id != real.id and real.id.endswith(f"tokens={real.max_num_batched_tokens}")  # saved models differ
    load = {
        "running": 12,
        "waiting": 2,
        "inflight_requests": 14,
        "inflight_prefill_tokens": 3000,
        "inflight_decode_tokens": 20000,
    }
    engine = real.estimate(1500, 200, 300, **load, prefill_rate_tps=8000.0, since_last_token_ms=8.0)
    wall = fast.estimate(1500, 200, 300, **load, prefill_rate_tps=32000.0, since_last_token_ms=2.0)
    assert wall.ttft_ms == pytest.approx(engine.ttft_ms / 4, rel=1e-9)
    assert wall.tpot_ms == pytest.approx(engine.tpot_ms / 4, rel=1e-9)
    assert wall.batch_requests == engine.batch_requests

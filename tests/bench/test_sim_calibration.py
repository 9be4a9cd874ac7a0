"""The calibration benchmark's replay: the same step times and step composition as the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from backends.perf.presets import resolve_preset
from backends.perf.roofline import step_time_s
from bench.sim_calibration import public, scenarios


@pytest.mark.parametrize("preset_name", ["llama-3.1-8b@h100", "qwen3-8b@ascend-910b", "llama-3.1-70b-tp4@a100"])
def test_vectorised_step_times_equal_the_roofline(preset_name: str) -> None:
    preset = resolve_preset(preset_name)
    rng = np.random.default_rng(1)
    steps = []
    for _ in range(40):
        chunks = [(int(rng.integers(1, 3000)), int(rng.integers(0, 30_000))) for _ in range(rng.integers(0, 3))]
        decodes = [int(c) for c in rng.integers(0, 40_000, size=rng.integers(0, 50))]
        if chunks or decodes:
            steps.append((chunks, decodes))
    rows = [
        (
            sum(n for n, _ in c) + len(d),
            len(c) + len(d),
            sum(n * (ctx + (n + 1) / 2) for n, ctx in c) + sum(d) + len(d),
            sum(ctx for _, ctx in c) + sum(d),
            bool(c),
        )
        for c, d in steps
    ]
    data = np.array([r[:4] for r in rows], dtype=float)
    schedule = scenarios.Schedule(
        tokens=data[:, 0],
        sampled=data[:, 1],
        attention_pairs=data[:, 2],
        kv_read=data[:, 3],
        has_prefill=np.array([r[4] for r in rows]),
        first_token_step=np.array([0]),
        last_token_step=np.array([0]),
        outputs=np.array([1.0]),
        requests_per_run=1,
    )
    expected = [step_time_s(preset, c, d) for c, d in steps]
    assert scenarios.step_times(preset, schedule) == pytest.approx(expected, rel=1e-12)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    # A100: vLLM's default budget is 2,048 tokens a step; the first token comes with the last chunk
    workload = scenarios.Workload(5_000, 3, 1, all_at_once=False)
    s = scenarios.schedule("llama-3.1-8b@a100", workload)
    assert list(s.tokens) == [2048, 2048, 904, 1, 1]
    assert list(s.has_prefill) == [True, True, True, False, False]
    assert (s.first_token_step[0], s.last_token_step[0]) == (2, 4)
    outcome = scenarios.evaluate(resolve_preset("llama-3.1-8b@a100"), workload, s)
    assert outcome.ttft_s > resolve_preset("llama-3.1-8b@a100").efficiency.frontend_s


def test_running_requests_are_scheduled_before_waiting_prefills() -> None:
    # all at once: the budget fills with the first prompt's chunks, later prompts wait; once a request
    # decodes, every step carries its decode token first and prefill chunks in what is left
    s = scenarios.schedule("llama-3.1-8b@a100", scenarios.Workload(3_000, 50, 3, all_at_once=True))
    assert s.tokens[0] == 2048 and s.has_prefill[0]
    assert list(s.first_token_step) == sorted(s.first_token_step)
    assert s.tokens.max() <= 2048


def test_every_measurement_cites_a_source() -> None:
    for m in public.MEASUREMENTS:
        source = public.SOURCES[m.source]
        assert source.url.startswith("https://") and source.engine
        assert any(v is not None for v in (m.ttft_ms, m.tpot_ms, m.duration_s))
        resolve_preset(m.preset)

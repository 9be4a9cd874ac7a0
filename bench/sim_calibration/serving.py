"""Fit each hardware's serving factors to published end-to-end runs, and score every run.

The objective is log(simulated/measured) of each reported metric of each run (mean TTFT, mean TPOT,
duration), by least squares: a relative error, symmetric in over- and under-prediction. Only a few
factors are free per hardware (`PLAN`), those the runs can tell apart: the GEMM and attention
efficiencies (prefill-bound runs at 2k, 4k and 32k tokens), the bandwidth efficiency and the host
costs (one-request decode, and decode inside large batches). Everything else keeps its value:
tensor-parallel factors from the previous fit on kernel sums and multi-GPU runs, and, for hardware
without runs of its own, the factors of its nearest sibling (`DERIVED`).

A run can be kept out of the fit while still being scored (`Exclusion`): when it measured a
different engine behaviour than the one the simulator implements, fitting it would bend the factors
for every other workload.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from backends.perf.hardware import Efficiency
from backends.perf.presets import Preset, resolve_preset
from bench.sim_calibration import scenarios
from bench.sim_calibration.public import MEASUREMENTS, Measurement

METRICS = ("ttft", "tpot", "duration")
BOUNDS: dict[str, tuple[float, float]] = {
    "compute": (0.05, 1.0),
    "attention": (0.02, 1.0),
    "bandwidth": (0.1, 1.0),
    "step_overhead_s": (0.0, 0.05),
    "prefill_overhead_s": (0.0, 0.1),
    "sequence_overhead_s": (0.0, 0.002),
    "frontend_s": (0.0, 0.2),
}


@dataclass(frozen=True, slots=True)
class Exclusion:
    """Metrics of a run that are scored but not fitted, and why."""

    source: str
    metrics: tuple[str, ...]
    reason: str


EXCLUSIONS: tuple[Exclusion, ...] = (
    Exclusion(
        "gpustack-qwen3-8b-h100",
        ("ttft",),
        "vLLM 0.11's API server: 59 ms to the first token of a 233-token prompt, where vLLM 0.21 "
        "takes 14 ms end to end (inferencebench); the simulator follows the newer frontend",
    ),
    Exclusion(
        "gpustack-qwen3-8b-910b",
        ("tpot",),
        "vLLM-Ascend 0.9.1 does not batch decodes with prefill chunks as vLLM V1 does: its median "
        "ITL (56 ms) is a decode step alone and its mean (99 ms) includes whole prefills in between; "
        "the simulator runs V1's chunked prefill, so only the prefill side (TTFT, duration) is fitted",
    ),
)


@dataclass(frozen=True, slots=True)
class FitPlan:
    """Which runs a hardware is fitted on, and which factors are free."""

    select: Callable[[Measurement], bool]
    free: tuple[str, ...]
    start_from: str | None = None  # the factors not free come from this hardware's result
    fixed: dict[str, Any] = field(default_factory=dict)  # set before fitting
    note: str = ""  # written into the preset's Efficiency


PLAN: dict[str, FitPlan] = {
    "h100": FitPlan(
        lambda m: m.preset.endswith("@h100"),
        ("compute", "bandwidth", "step_overhead_s", "sequence_overhead_s", "frontend_s"),
        # vLLM V1 runs prefill under piecewise CUDA graphs: no separate cost for a step with prefill
        fixed={"prefill_overhead_s": 0.0},
    ),
    "a100": FitPlan(
        lambda m: m.preset.endswith("@a100") or m.preset.endswith("@a100-40gb"),
        ("compute", "bandwidth", "step_overhead_s", "sequence_overhead_s"),
        start_from="h100",
    ),
    "ascend-910b": FitPlan(
        lambda m: m.preset.endswith("@ascend-910b"),
        ("compute", "attention"),
        start_from="a100",
        note="prefill (GEMM, attention) fitted on vLLM-Ascend 0.9.1; decode and host factors from a100",
    ),
}
# hardware that takes another's fitted factors, and why (written into the preset's note)
DERIVED: dict[str, tuple[str, str]] = {
    "h200": ("h100", "H100 factors (same Hopper chip and stack); checked on vLLM CI's batch-8 latency"),
}


@dataclass(frozen=True, slots=True)
class Checked:
    """One metric of one run: measured and simulated."""

    measurement: Measurement
    metric: str
    measured: float  # ms for ttft/tpot, s for duration
    simulated: float
    excluded: str = ""  # the reason it is not part of the fit, if it is not

    @property
    def error(self) -> float:
        return self.simulated / self.measured - 1.0


def _measured(m: Measurement, metric: str) -> float | None:
    return {"ttft": m.ttft_ms, "tpot": m.tpot_ms, "duration": m.duration_s}[metric]


def _exclusion(m: Measurement, metric: str) -> str:
    for e in EXCLUSIONS:
        if e.source == m.source and metric in e.metrics:
            return e.reason
    return ""


def check(m: Measurement, preset: Preset) -> list[Checked]:
    """Replay the run with `preset`'s factors and compare every metric it reports."""
    outcome = scenarios.evaluate(preset, m.workload, scenarios.schedule(m.preset, m.workload))
    simulated = {"ttft": outcome.ttft_s * 1e3, "tpot": outcome.tpot_s * 1e3, "duration": outcome.duration_s}
    out = []
    for metric in METRICS:
        measured = _measured(m, metric)
        if measured is not None:
            out.append(Checked(m, metric, measured, simulated[metric], _exclusion(m, metric)))
    return out


def _residuals(measurements: Sequence[Measurement], efficiency: Efficiency) -> np.ndarray:
    values = []
    for m in measurements:
        preset = resolve_preset(m.preset).with_efficiency(efficiency)
        values += [np.log(c.simulated / c.measured) for c in check(m, preset) if not c.excluded]
    return np.array(values)


def fit_hardware(measurements: Sequence[Measurement], base: Efficiency, free: Sequence[str]) -> Efficiency:
    def start(name: str) -> float:
        lo, hi = BOUNDS[name]
        value = getattr(base, name)
        value = base.compute if value is None else value
        return float(min(max(value, lo + 1e-6), hi - 1e-6))

    def efficiency(x: Sequence[float] | np.ndarray) -> Efficiency:
        values: dict[str, Any] = {name: float(v) for name, v in zip(free, x, strict=True)}
        return replace(base, **values)

    result = least_squares(
        lambda x: _residuals(measurements, efficiency(x)),
        [start(name) for name in free],
        bounds=([BOUNDS[n][0] for n in free], [BOUNDS[n][1] for n in free]),
    )
    return efficiency(result.x)


def fit_all() -> dict[str, Efficiency]:
    """Every planned hardware in order (a plan may take its fixed factors from an earlier result),
    then the derived ones. Tensor-parallel factors always stay the hardware's own."""
    fitted: dict[str, Efficiency] = {}
    for hw, plan in PLAN.items():
        rows = [m for m in MEASUREMENTS if plan.select(m)]
        start = replace(resolve_preset(rows[0].preset).efficiency, calibrated=True, note=plan.note, **plan.fixed)
        if plan.start_from:
            donor = fitted[plan.start_from]
            start = replace(start, **{n: getattr(donor, n) for n in BOUNDS if n not in plan.free})
        fitted[hw] = fit_hardware(rows, start, plan.free)
    for hw, (donor_hw, note) in DERIVED.items():
        own = resolve_preset(f"llama-3.1-8b@{hw}").efficiency
        fitted[hw] = replace(
            fitted[donor_hw],
            tp_scaling=own.tp_scaling,
            tp_overhead_s=own.tp_overhead_s,
            allreduce_latency_s=own.allreduce_latency_s,
            note=note,
        )
    return fitted


def check_all(efficiency_by_hw: dict[str, Efficiency] | None = None) -> list[Checked]:
    """Every public run, with the presets' factors or with `efficiency_by_hw` where given."""
    out: list[Checked] = []
    for m in MEASUREMENTS:
        preset = resolve_preset(m.preset)
        hw = preset.hardware.name
        family = "a100" if hw.startswith("a100") else hw
        if efficiency_by_hw and family in efficiency_by_hw:
            preset = preset.with_efficiency(efficiency_by_hw[family])
        out += check(m, preset)
    return out

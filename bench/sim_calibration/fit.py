"""Fit each hardware's `Efficiency` to its measured rows, and score presets against all rows.

The objective is the log of predicted/measured per row (a relative error, symmetric in over- and
under-prediction) under a soft-L1 loss, so that a few broken measurements (splitwise's batch-64
prefills at TP 2 finish faster than batch 32) cannot drag the fit. Each source gets the same total
weight, so 1,260 splitwise rows do not drown 60 kernel-sum rows. Rows that are kernel sums
(`device_only`) constrain only the device part of the model (compute, bandwidth, TP scaling,
all-reduce), never the overheads; a hardware whose only data are kernel sums takes its overheads
from `overheads_from`.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
from scipy.optimize import least_squares

from backends.perf import roofline
from backends.perf.capacity import batch_defaults
from backends.perf.presets import Efficiency, Preset, resolve_preset
from backends.sim.kv_cache import KVCacheManager
from backends.sim.request import Request
from backends.sim.scheduler import Scheduler
from bench.sim_calibration.sources import Row

PARAMS = (
    "compute",
    "bandwidth",
    "step_overhead_s",
    "prefill_overhead_s",
    "allreduce_latency_s",
    "tp_scaling",
    "tp_overhead_s",
)
OVERHEADS = ("step_overhead_s", "prefill_overhead_s", "tp_overhead_s")
LOWER = (0.05, 0.1, 0.0, 0.0, 0.0, 0.3, 0.0)
UPPER = (1.0, 1.0, 0.1, 0.2, 2e-3, 1.0, 0.1)
START = (0.5, 0.7, 0.005, 0.01, 2e-5, 0.8, 0.005)


@dataclass(frozen=True, slots=True)
class Scored:
    row: Row
    predicted_s: float

    @property
    def error(self) -> float:
        """Relative error of the prediction: (predicted - measured) / measured."""
        return self.predicted_s / self.row.measured_s - 1.0


StepWork = tuple[tuple[tuple[int, int], ...], tuple[int, ...]]


@functools.cache
def prefill_schedule(preset_name: str, batch: int, prompt: int) -> tuple[StepWork, ...]:
    """The steps the simulated engine runs until `batch` prompts submitted together all have their
    first token: vLLM V1's scheduler with the hardware's default token budget (chunked prefill, and
    early finishers decoding alongside). Independent of the efficiency factors, so computed once."""
    preset = resolve_preset(preset_name)
    max_seqs, budget = batch_defaults(preset)
    blocks = batch * (-(-(prompt + 2) // 16)) + 16
    scheduler = Scheduler(KVCacheManager(blocks, 16), max(max_seqs, batch), budget)
    requests = [Request(str(i), [i] * prompt, [0] * 4, "length", 0.0, 4) for i in range(batch)]
    for req in requests:
        scheduler.add(req)
    steps: list[StepWork] = []
    while any(r.first_token_s is None for r in requests):
        step = scheduler.schedule(0.0)
        steps.append((tuple((n, c) for _, n, c in step.prefills), tuple(c for _, c in step.decodes)))
        scheduler.complete_step(step, 1.0)
    return tuple(steps)


def predict(row: Row, preset: Preset) -> float:
    if row.kind == "decode":
        cost = roofline.step_cost(preset, (), [row.context] * row.batch)
        return cost.device_s if row.device_only else cost.total_s
    if row.device_only:  # a kernel sum of one step
        return roofline.step_cost(preset, [(row.prompt, 0)] * row.batch, ()).device_s
    return sum(
        roofline.step_time_s(preset, chunks, decodes)
        for chunks, decodes in prefill_schedule(row.preset, row.batch, row.prompt)
    )


def score(rows: Sequence[Row], efficiency_by_hw: dict[str, Efficiency] | None = None) -> list[Scored]:
    """Predictions with the presets' own factors, or with `efficiency_by_hw` where given."""
    out: list[Scored] = []
    cache: dict[str, Preset] = {}
    for row in rows:
        preset = cache.get(row.preset)
        if preset is None:
            preset = resolve_preset(row.preset)
            hw = preset.hardware.name
            if efficiency_by_hw and hw in efficiency_by_hw:
                preset = preset.with_efficiency(efficiency_by_hw[hw])
            cache[row.preset] = preset
        out.append(Scored(row, predict(row, preset)))
    return out


def fit_hardware(rows: Sequence[Row], fixed: Efficiency | None = None) -> Efficiency:
    """Least-squares factors for one hardware. With `fixed`, its overheads are kept (for data that
    cannot see overheads)."""
    presets = {name: resolve_preset(name) for name in {r.preset for r in rows}}
    per_source = Counter(r.source for r in rows)
    weights = np.array([1.0 / math.sqrt(per_source[r.source]) for r in rows])
    measured = np.array([r.measured_s for r in rows])
    free = [p for p in PARAMS if not (fixed is not None and p in OVERHEADS)]

    def efficiency(x: Sequence[float] | np.ndarray) -> Efficiency:
        values: dict[str, float] = {p: float(v) for p, v in zip(free, x, strict=True)}
        if fixed is not None:
            values.update({p: getattr(fixed, p) for p in OVERHEADS})
        return Efficiency(
            compute=values["compute"],
            bandwidth=values["bandwidth"],
            step_overhead_s=values["step_overhead_s"],
            prefill_overhead_s=values["prefill_overhead_s"],
            allreduce_latency_s=values["allreduce_latency_s"],
            tp_scaling=values["tp_scaling"],
            tp_overhead_s=values["tp_overhead_s"],
        )

    def residuals(x: np.ndarray) -> np.ndarray:
        eff = efficiency(x)
        predicted = np.array([predict(r, presets[r.preset].with_efficiency(eff)) for r in rows])
        return weights * np.log(predicted / measured)

    index = [PARAMS.index(p) for p in free]
    result = least_squares(
        residuals,
        [START[i] for i in index],
        bounds=([LOWER[i] for i in index], [UPPER[i] for i in index]),
        loss="soft_l1",
        f_scale=0.05,
    )
    return efficiency(result.x)


def fit_all(rows: Sequence[Row], overheads_from: dict[str, str]) -> dict[str, Efficiency]:
    """Fit every hardware that has rows; kernel-sum-only hardware borrows overheads (in order)."""
    by_hw: dict[str, list[Row]] = {}
    for row in rows:
        by_hw.setdefault(row.preset.split("@", 1)[1], []).append(row)
    fitted: dict[str, Efficiency] = {}
    order = sorted(by_hw, key=lambda hw: hw in overheads_from)
    for hw in order:
        donor = overheads_from.get(hw)
        hw_rows = by_hw[hw]
        if donor is not None and all(r.device_only for r in hw_rows):
            fitted[hw] = replace(
                fit_hardware(hw_rows, fixed=fitted[donor]),
                note=f"overheads from {donor}; device factors fitted on kernel sums",
            )
        else:
            fitted[hw] = fit_hardware(hw_rows)
    return fitted


def python_literal(name: str, eff: Efficiency) -> str:
    """The factors as the statement pasted into presets.py (one keyword per line)."""
    lines = [f"{name} = Efficiency("]
    for f in fields(Efficiency):
        value = getattr(eff, f.name)
        if f.name in PARAMS:
            rounded = float(f"{value:.4g}") if abs(value) >= 1e-9 else 0.0
            lines.append(f"    {f.name}={rounded!r},")
        elif f.name == "note" and value:
            lines.append(f"    note={value!r},")
    lines.append(")")
    return "\n".join(lines)

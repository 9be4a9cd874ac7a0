"""Score the step-time measurements (kernel sums, 2023-24 engines) and print fitted factors.

These rows time single steps: AIConfigurator's kernel sums inside vLLM 0.24 (device time only), and
the end-to-end prefill and decode timings of splitwise's and DistServe's engines. They are scored
against the presets as a cross-check; the factors themselves are fitted on public serving runs of
current vLLM (`serving.py`), because kernels alone run faster than a serving engine's steps and the
older engines' host costs are several times vLLM V1's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields

from backends.perf import roofline
from backends.perf.hardware import Efficiency
from backends.perf.presets import Preset, resolve_preset
from backends.perf.roofline import batch_defaults
from bench.sim_calibration.sources import Row
from sim.kv_cache import KVCacheManager
from sim.scheduler import Request, Scheduler

# the factors `python_literal` writes, in the order of the results table
PARAMS = (
    "compute",
    "attention",
    "bandwidth",
    "step_overhead_s",
    "prefill_overhead_s",
    "sequence_overhead_s",
    "frontend_s",
    "allreduce_latency_s",
    "tp_scaling",
    "tp_overhead_s",
)


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


def python_literal(name: str, eff: Efficiency) -> str:
    """The factors as the statement pasted into backends/perf/hardware.py (one keyword per line)."""
    lines = [f"{name} = Efficiency("]
    for f in fields(Efficiency):
        value = getattr(eff, f.name)
        if f.name in PARAMS:
            if value is None:
                continue
            rounded = float(f"{value:.4g}") if abs(value) >= 1e-9 else 0.0
            lines.append(f"    {f.name}={rounded!r},")
        elif f.name == "calibrated" and not value:
            lines.append("    calibrated=False,")
        elif f.name == "note" and value:
            lines.append(f"    note={value!r},")
    lines.append(")")
    return "\n".join(lines)

"""bench/results/sim-calibration.md and .png: how close the simulated engine is to real engines."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from backends.perf.hardware import HARDWARE, Efficiency
from backends.perf.presets import resolve_preset
from bench.sim_calibration.fit import PARAMS, Scored
from bench.sim_calibration.public import SOURCES
from bench.sim_calibration.scenarios import Workload, evaluate, schedule
from bench.sim_calibration.serving import EXCLUSIONS, METRICS, Checked

TARGET = 0.15
UNITS = {"ttft": "ms", "tpot": "ms", "duration": "s"}
LEGACY_NOTES = {
    "splitwise": "splitwise_sim/perf_model.csv: measured prefill (prompt_time) and per-token decode "
    "(token_time) on DGX-A100/H100; engine not named by the repository (2023-24 software)",
    "distserve-vllm": "distserve/profiler-a100-80g.vllm.json: DistServe's fit of vLLM profiles on "
    "A100-80G, evaluated on a grid inside the profiled KV capacity (max_num_tokens.csv)",
    "aiconfigurator": "aiconfigurator/{h100,h200}_sxm/vllm_0.24.0: per-kernel latencies inside vLLM "
    "0.24 summed into steps (prefill to 16k tokens, decode to 64k of context); no CPU time, so "
    "compared with the model's device time",
}
CITATIONS = (
    "vLLM V1's step composition (running requests first, then waiting ones FCFS in chunks of the "
    "remaining token budget), which the replay inherits from `sim/scheduler.py`: "
    "https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/sched/scheduler.py",
    "H100 serving about 2x A100, not the 3.2x of their datasheet peaks (Lambda's vLLM benchmark): "
    "https://github.com/LambdaLabsML/vllm-benchmark/blob/main/benchmark_v0.md",
)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f} %"


def _g(x: float | None) -> str:
    if x is None:
        return "="
    return "0" if abs(x) < 1e-9 else f"{x:.4g}"


def _abs_median(items: Sequence[Scored]) -> float:
    return statistics.median(abs(s.error) for s in items)


def _value(x: float, metric: str) -> str:
    return f"{x:,.1f}" if metric != "duration" or x >= 10 else f"{x:.3g}"


def write(
    checked: Sequence[Checked], scored: Sequence[Scored], out_dir: Path, fitted: dict[str, Efficiency] | None
) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_path = out_dir / "sim-calibration.png"
    _plot(checked, scored, plot_path)
    target = [c for c in checked if not c.excluded]
    met = sum(abs(c.error) <= TARGET for c in target)
    lines = [
        "# Simulated engine calibration",
        "",
        "How close the simulated engine (`sim`, its GPU being `backends/perf`) is to real serving",
        "engines. Published benchmark runs of vLLM (and vLLM-Ascend) are replayed through the simulator's",
        "own scheduler with the same workload, and the run's mean TTFT, mean TPOT and duration are",
        "compared (`bench/sim_calibration/scenarios.py`). Reproduce with `python -m bench.sim_calibration`",
        "(score the presets as they are) or `python -m bench.sim_calibration --fit --write-presets`",
        "(refit the serving factors and paste them into `backends/perf/hardware.py`).",
        "",
        f"**{met} of {len(target)} fitted metrics are within {TARGET * 100:.0f} %** of the published figure "
        f"(target: all of them); every run and metric is listed below with its source.",
        "",
        "## By hardware and context length",
        "",
        "Errors are (simulated - measured) / measured. Long means a prompt of 16k tokens or more.",
        "",
        "| hardware | context | metric | runs | within 15 % | largest \\|error\\| |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    groups: dict[tuple[str, str, str], list[Checked]] = defaultdict(list)
    for c in target:
        hw = c.measurement.preset.split("@", 1)[1]
        groups[(hw, c.measurement.context, c.metric)].append(c)
    for (hw, context, metric), items in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], METRICS.index(kv[0][2]))
    ):
        worst = max(abs(c.error) for c in items)
        within = sum(abs(c.error) <= TARGET for c in items)
        lines.append(f"| {hw} | {context} | {metric} | {len(items)} | {within} | {worst * 100:.1f} % |")
    lines += [
        "",
        "Hardware without a public run of its own: `h200` takes the H100 factors (same chip and software) and",
        "is checked on one run; `h20` has none at all (see below). Runs on `a100-40gb` check the `a100` factors.",
        "",
        "## Every run",
        "",
        "| preset | run | engine | metric | measured | simulated | error | fitted |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for c in checked:
        m = c.measurement
        unit = UNITS[c.metric]
        lines.append(
            f"| `{m.preset}` | {m.label} | {SOURCES[m.source].engine} | {c.metric} ({unit}) | "
            f"{_value(c.measured, c.metric)} | {_value(c.simulated, c.metric)} | {_pct(c.error)} | "
            f"{'no (below)' if c.excluded else 'yes'} |"
        )
    lines += ["", "Sources (each row's numbers are copied from its page):", ""]
    lines += [f"- **{key}** ({s.engine}): {s.note}. {s.url}" for key, s in SOURCES.items()]
    lines += ["", "## Metrics scored but not fitted", ""]
    lines += [f"- **{e.source}** ({', '.join(e.metrics)}): {e.reason}." for e in EXCLUSIONS]
    lines += [
        "",
        "## Step-time cross-checks: kernel sums and 2023-24 engines",
        "",
        "Single steps timed elsewhere, scored against the same factors (not fitted; the factors above are",
        "fitted on serving runs). Kernel sums leave out the host and the gaps between kernels, and the",
        "2023-24 engines paid several times vLLM V1's host cost per step, so their bias says how far those",
        "step timings are from today's served steps rather than how wrong the simulator is.",
        "",
        "| source | kind | rows | median \\|err\\| | median signed (bias) | long context (>= 16k) rows, bias |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    legacy: dict[tuple[str, str], list[Scored]] = defaultdict(list)
    for s in scored:
        legacy[(s.row.source, s.row.kind)].append(s)
    for (source, kind), rows in sorted(legacy.items()):
        bias = statistics.median(s.error for s in rows)
        long_rows = [s for s in rows if max(s.row.prompt, s.row.context) >= 16_000]
        long_cell = f"{len(long_rows)}, {_pct(statistics.median(s.error for s in long_rows))}" if long_rows else "-"
        lines.append(
            f"| {source} | {kind} | {len(rows)} | {_abs_median(rows) * 100:.1f} % | {_pct(bias)} | {long_cell} |"
        )
    lines += ["", "Sources:", ""]
    lines += [f"- **{name}**: {note}." for name, note in LEGACY_NOTES.items()]
    lines += [
        "",
        "## Efficiency factors",
        "",
        "Per hardware, fitted by least squares on log(simulated/measured) of the runs' metrics",
        "(`bench/sim_calibration/serving.py`: which factors each hardware frees, which it takes from a",
        "sibling). `=` in `attention`: the GEMM factor. Tensor-parallel factors (`allreduce_latency_s`,",
        "`tp_scaling`, `tp_overhead_s`) are kept from the previous fit on multi-GPU kernel sums and runs.",
        "",
        "| hardware | " + " | ".join(PARAMS) + " | calibrated | note |",
        "| --- | " + " | ".join("---:" for _ in PARAMS) + " | --- | --- |",
    ]
    for name, spec in HARDWARE.items():
        family = "a100" if name.startswith("a100") else name
        eff = (fitted or {}).get(family, spec.efficiency)
        values = " | ".join(_g(getattr(eff, p)) for p in PARAMS)
        lines.append(f"| {name} | {values} | {'yes' if eff.calibrated else 'no'} | {eff.note} |")
    lines += _long_prompt_table(fitted)
    lines += READING
    lines += ["", "Also cited:", ""]
    lines += [f"- {c}" for c in CITATIONS]
    lines += ["", "![simulated vs measured](sim-calibration.png)", ""]
    md_path = out_dir / "sim-calibration.md"
    md_path.write_text("\n".join(lines))
    return md_path, plot_path


ISSUE_WORKLOAD = Workload(21_000, 256, 1, all_at_once=False)


def _long_prompt_table(fitted: dict[str, Efficiency] | None) -> list[str]:
    """One 21k-token request on an idle engine, per hardware: what the simulator now says."""
    lines = [
        "",
        "## One long request, per hardware",
        "",
        "Llama-3.1-8B, one request of 21,000 prompt tokens and 256 output tokens on an idle engine (the shape",
        "of the real-vLLM runs issue 20 compared against), as the simulator now runs it:",
        "",
        "| hardware | TTFT (ms) | TPOT (ms) | calibrated |",
        "| --- | ---: | ---: | --- |",
    ]
    for name in ("a100", "h100", "h200", "h20", "ascend-910b"):
        preset = resolve_preset(f"llama-3.1-8b@{name}")
        eff = (fitted or {}).get(name, preset.efficiency)
        outcome = evaluate(preset.with_efficiency(eff), ISSUE_WORKLOAD, schedule(preset.name, ISSUE_WORKLOAD))
        calibrated = "yes" if eff.calibrated else "no"
        lines.append(f"| {name} | {outcome.ttft_s * 1e3:,.0f} | {outcome.tpot_s * 1e3:.2f} | {calibrated} |")
    return lines


READING = [
    "",
    "## Reading the numbers",
    "",
    "- **Served steps are slower than their kernels on Hopper.** The H100 runs fit a GEMM efficiency of",
    "  0.35 of the datasheet's 989 TFLOP/s, where AIConfigurator's kernel sums alone imply about 0.7: a",
    "  served prefill step also pays sustained clocks under load, the kernels between the GEMMs and",
    "  the gaps between steps. The A100 runs fit 0.57 of 312 TFLOP/s, so served H100 prefill is about",
    "  2x A100's, as Lambda's benchmark found (cited below), not the 3.2x of the peaks. Kernel-sum rows",
    "  therefore show the simulator about 2x slower than the kernels for prefill (the cross-check",
    "  table), and about 12 % slower for decode, where served and kernel bandwidths are close.",
    "- **Host cost scales with the batch, not the step.** Every hardware's fit puts the fixed cost of",
    "  a step near zero (CUDA graphs, asynchronous scheduling) and a cost per scheduled sequence of",
    "  0.18 ms (H100) to 0.33 ms (A100): preparing inputs, sampling and streaming each request's",
    "  token. One request decodes at the memory roofline (A100 40GB: 13.4 ms per token against 13.3",
    "  measured); hundreds of requests in a step add tens of milliseconds, as the 2k and 4k runs show.",
    "- **Long prompts.** At 32k tokens the A100 and H100 runs are within 3 % on TTFT, TPOT and duration",
    "  with one GEMM efficiency for matmuls and attention. vLLM-Ascend's attention is the exception:",
    "  its 32k prompts take 11 s on a 910B, which fits an attention efficiency of 0.11 against 0.64 for",
    "  its GEMMs.",
    "- **The frontend** (`frontend_s`, 3.5 ms) comes from the only short-prompt TTFT of a current vLLM",
    "  found (vLLM 0.21, whose page gives no prompt length; 256 tokens assumed). vLLM 0.11 took 45 ms",
    "  more for the same kind of request; that run is scored but not fitted.",
    "- **Step composition** is the simulator's own scheduler (vLLM V1's: running requests first, then",
    "  waiting ones in chunks of the remaining budget of 2,048 tokens on A100-class devices, 8,192 on",
    "  H100/H200, 16,384 at 160 GB and more). Against the real vLLM 0.32 (its CPU build, small budget,",
    "  three request mixes) every step schedules the same tokens for the same requests:",
    "  [sim-steps.md](sim-steps.md) (`python -m bench.sim_calibration.steps`).",
    "",
    "## Not met, and what would close it",
    "",
    "- **H20: no public measurement found.** Its factors are still the 2024 H100 fit (kernel-level",
    "  GEMM efficiency 0.71, 2023-24 host costs), unchanged and marked uncalibrated. Issue 20's",
    "  private runs found its prefill too slow and its decode close. One H20 run of the workloads",
    "  above (random 2k, 4k and 32k prompts at request rate inf, and one request at a time) would",
    "  calibrate it the way A100 and H100 are here.",
    "- **H200** is checked on one short run (vLLM CI's batch-8 latency, -5 %); its long-context",
    "  behaviour rests on the H100 factors and its own datasheet bandwidth.",
    "- **Ascend 910B decode is not calibrated**: vLLM-Ascend 0.9.1 did not run V1's chunked prefill",
    "  (see the exclusions), so only its prefill factors are fitted; its TPOT under load is 40-90 %",
    "  too high. A run with one request at a time, or the simulator modelling that scheduler, would",
    "  close it.",
    "- **Issue 20's own figures** (Llama-3.1-8B, ~21k-token prompts, A100 and H20) are not public and",
    "  are not in this table. With these factors the A100's decode step at 21k of context is 12 ms",
    "  (22 ms before this recalibration) and its 21k prefill 2.3 s (2.5 s before); whether that closes",
    "  the gap the issue saw needs its runs.",
    "- **Tensor parallelism** keeps the previous fit's factors: no public multi-GPU serving run with a",
    "  known workload was found.",
    "- ShareGPT runs are replayed with their mean lengths, not the dataset's distribution.",
]


def _plot(checked: Sequence[Checked], scored: Sequence[Scored], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 6.5), gridspec_kw={"width_ratios": [1.3, 1]})
    ax = axes[0]
    labels = [f"{c.measurement.preset} {c.measurement.label} {c.metric}" for c in checked]
    ratios = [c.simulated / c.measured for c in checked]
    colors = ["tab:gray" if c.excluded else ("tab:green" if abs(c.error) <= TARGET else "tab:red") for c in checked]
    y = range(len(checked))
    ax.barh(list(y), [r - 1 for r in ratios], left=1, color=colors)
    ax.axvline(1, color="black", linewidth=1)
    for factor in (1 - TARGET, 1 + TARGET):
        ax.axvline(factor, color="gray", linewidth=0.8, linestyle="--")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("simulated / measured (grey: scored, not fitted)")
    ax.set_title("public serving runs")
    ax = axes[1]
    sources = {"splitwise": "tab:blue", "distserve-vllm": "tab:orange", "aiconfigurator": "tab:green"}
    for source, color in sources.items():
        pts = [(s.row.measured_s * 1e3, s.predicted_s * 1e3) for s in scored if s.row.source == source]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, s=8, alpha=0.5, color=color, label=f"{source} ({len(pts)})")
    lo = min(min(s.row.measured_s, s.predicted_s) for s in scored) * 1e3 * 0.8
    hi = max(max(s.row.measured_s, s.predicted_s) for s in scored) * 1e3 * 1.2
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("simulated step (ms)")
    ax.set_title("cross-check: kernel sums and 2023-24 engines")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="both", alpha=0.2)
    fig.suptitle("sim vs real engines (dashed: ±15 %)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

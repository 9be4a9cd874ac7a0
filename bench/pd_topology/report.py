"""The markdown table and PNG plot of a pd_topology run: per variant, the mean over seeds and the spread."""

from __future__ import annotations

import argparse
import platform
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.notes import section
from bench.pd_topology.run import NO_SPINE, VARIANTS, Outcome, Spec, pct


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, sd


def render(
    args: argparse.Namespace,
    specs: list[Spec],
    outcomes: list[Outcome],
    rates: dict[int, float],
    floors: dict[tuple[int, str], float],
    elapsed: float,
) -> tuple[str, Callable[[Path], None]]:
    seeds = sorted({o.seed for o in outcomes})
    spec = specs[0]
    lines = [
        "# PD pairing across a two-rack topology: topology-blind vs topology-aware",
        "",
        f"`python -m bench.pd_topology` ({'quick' if args.quick else 'full'} run, {elapsed:.0f} s on "
        f"{platform.python_implementation()} {platform.python_version()}). A disaggregated pool of simulated "
        f"llama-3.1-8b@h100 engines in {spec.racks} racks of {spec.prefill_per_rack} prefill + "
        f"{spec.decode_per_rack} decode replicas, in process (discrete events on one virtual clock: no host "
        "noise). KV transfer from prefill to decode charged by link (128 KiB per token), one transfer at a "
        f"time per sending NIC: same rack + {spec.rack_latency_ms:g} ms, across racks + "
        f"{spec.spine_latency_ms:g} ms, bandwidths per device as in each row (rack / spine GB/s; the router is "
        f"told the same links). Synthetic workload: {args.requests} requests per seed, Poisson arrivals at "
        f"{args.load:.0%} of the prefill replicas' throughput "
        f"({', '.join(f'seed {s}: {rates[s]:.2f} req/s' for s in seeds)}), prompts log-normal around "
        f"{args.prompt_median:,} tokens (1k to 16k, no shared prefixes: every request is disaggregated), "
        "outputs 32 to 256 tokens. Mean over seeds, ± the standard deviation across seeds.",
        "",
        "| links (GB/s) | variant | p50 TTFT (s) | p90 TTFT (s) | p99 TTFT (s) | p90 blind / this "
        "| pairs across racks | mean KV transfer (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    p90: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}  # (links, variant) -> per seed, p90 blind / variant
    for s in specs:
        for v in VARIANTS:
            p90[s.label, v] = [pct(o.ttft_s, 0.9) for o in outcomes if o.links == s.label and o.variant == v]
        for v in VARIANTS[1:]:
            if len(p90[s.label, v]) == len(p90[s.label, "blind"]):
                pairs = zip(p90[s.label, "blind"], p90[s.label, v], strict=True)
                ratios[s.label, v] = [b / a for b, a in pairs if a > 0]
    for s in specs:
        for v in VARIANTS:
            runs = [o for o in outcomes if o.links == s.label and o.variant == v]
            if not runs:
                continue
            p50m, p50s = _mean_sd([pct(o.ttft_s, 0.5) for o in runs])
            p90m, p90s = _mean_sd(p90[s.label, v])
            p99m, p99s = _mean_sd([pct(o.ttft_s, 0.99) for o in runs])
            cm, cs = _mean_sd([o.cross_rack / max(o.disaggregated, 1) for o in runs])
            tm, ts = _mean_sd([o.transfer_s * 1e3 for o in runs])
            rv = ratios.get((s.label, v), [])
            rm, rs = _mean_sd(rv) if rv else (0.0, 0.0)
            ratio = f"{rm:.2f}x ± {rs:.2f} (min {min(rv):.2f}x)" if rm else ""
            lines.append(
                f"| {s.label} | {v} | {p50m:.3f} ± {p50s:.3f} | {p90m:.3f} ± {p90s:.3f} | {p99m:.3f} ± {p99s:.3f} "
                f"| {ratio} | {cm:.1%} ± {cs:.1%} | {tm:.1f} ± {ts:.1f} |"
            )
    lines += [
        "",
        "Per seed, p90 TTFT blind / aware: "
        + "; ".join(
            f"{label}: " + ", ".join(f"{r:.2f}x" for r in rs) for (label, v), rs in ratios.items() if v == "aware"
        ),
        "",
        "Per seed, p90 TTFT blind / no-spine (the most any pairing could gain): "
        + "; ".join(
            f"{label}: " + ", ".join(f"{r:.2f}x" for r in rs) for (label, v), rs in ratios.items() if v == NO_SPINE
        ),
        "",
        "Per seed, aware / no-spine p90 (1.00: pairing reaches the bound): "
        + "; ".join(
            f"{s.label}: "
            + ", ".join(
                f"{a / b:.2f}" for a, b in zip(p90[s.label, "aware"], p90[s.label, NO_SPINE], strict=False) if b > 0
            )
            for s in specs
        ),
        "",
        "No-queue floor, p90 over requests of prefill alone on an idle replica + transfer over the rack's link (s): "
        + "; ".join(
            f"{s.label}: " + ", ".join(f"{floors[seed, s.label]:.3f}" for seed in seeds if (seed, s.label) in floors)
            for s in specs
        ),
        "",
        "- `blind`: `routing.pd.topology.aware: false`: the decode pipeline and the prefill pipeline choose on "
        "their own, so about half the pairs cross the spine.",
        "- `aware`: the pair with the least prefill time + KV transfer time over its link, among the decode "
        "endpoints within `decode_slack` of the best and the prefill endpoints the prefill pipeline kept "
        "(docs/routing.md#topology-aware-pairing).",
        "- `no-spine` (a bound): `aware` on the same fleet with the cross-rack link as fast as the rack's: no pair "
        "pays the spine, so blind / no-spine is the most any pairing policy can gain on that fabric.",
        "- Transfer time is measured from the decode leg's admission to its KV's landing (queueing behind the "
        "sender's earlier transfers included). What pairing can save is the transfer's share of TTFT: the "
        "slower the spine against the prefill time, the larger the gain.",
        "",
        *section(args.out),
    ]
    text = "\n".join(lines)

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [s.label for s in specs]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        width = 0.27
        for k, (v, color) in enumerate(zip(VARIANTS, ["#999", "#393", "#69c"], strict=True)):
            xs = [i + (k - 1) * width for i in range(len(labels))]
            values = [p90[label, v] for label in labels]
            means = [statistics.fmean(x) if x else 0.0 for x in values]
            errs = [statistics.stdev(x) if len(x) > 1 else 0.0 for x in values]
            ax.bar(xs, means, width, yerr=errs, capsize=3, color=color, label=v)
            for x, vals in zip(xs, values, strict=True):
                ax.scatter([x] * len(vals), vals, color="k", s=6, zorder=3)
        ax.set_xticks(range(len(labels)), [f"rack {label.replace('/', ' / spine ')} GB/s" for label in labels])
        ax.set_ylabel("p90 TTFT (simulated s)")
        ax.set_title("PD pairing across two racks: p90 TTFT")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return text, plot

"""Tool-boundary affinity: next-turn prefix hits of agent programs with and without the
`tool-affinity` scorer, on a saturated pool of simulated replicas.

    .venv/bin/python -m bench.tool_affinity [--seeds 1 2 3] [--programs 240] [--quick]

1. τ²-bench retail sessions (workload.py) replayed as agent programs arriving as a Poisson process,
   each turn sent when the last answered and its recorded pause passed; unrelated one-shot requests
   (unique prompts) arrive beside them. 92 agent turns of the trace: 43 % end in tool calls.
2. A pool of `--replicas` simulated Llama-3.1-8B@H100 engines in process (fleet.py: the simulator's
   scheduler, paged KV with prefix caching and LRU eviction, roofline step times, a simulated clock),
   each with `--kv-blocks` blocks of 16 tokens: small enough that the programs' histories and the
   unrelated prompts do not all fit, so an idle program's prefix is evicted unless something keeps it.
3. The same arrivals per seed through the gateway's router (default pipeline) and through it with
   `tool-affinity` added (weight `--weight`); per turn that follows a tool-call answer: the prompt
   tokens the engine found cached over those the previous turn left there (its prompt), and TTFT.

Writes bench/results/tool-affinity.md, tool-affinity.png and raw/tool-affinity-raw.json.gz.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import notes, raw
from bench.tool_affinity.fleet import Job, SimPool
from bench.tool_affinity.workload import (
    SHARED_TOKENS,
    VOCAB,
    Program,
    background,
    load_sessions,
    programs,
    shared_ids,
)
from bench.traces import TRACES, require
from policies.routing.config import ComponentSpec, PipelineConfig, RoutingConfig
from policies.routing.pipeline import build_router

RESULTS = Path(__file__).resolve().parents[1] / "results"
SESSIONS = "exgentic_tau2_retail_10"
VARIANTS = ("default", "session", "tool-affinity")
TARGET_POINTS = 20.0


def routing_config(variant: str, weight: float, seed: int, offload_tokens: int = 0) -> RoutingConfig:
    """The variant's pipeline; with a DRAM tier on the replicas the approximate index models it too."""
    pipeline = PipelineConfig()
    if variant == "tool-affinity":
        scorers = [*pipeline.scorers, ComponentSpec(type="tool-affinity", weight=weight)]
        pipeline = PipelineConfig(filters=pipeline.filters, scorers=scorers, picker=pipeline.picker)
    config = RoutingConfig(default=pipeline, seed=seed)
    if offload_tokens:
        tiers = config.kv_tiers.model_copy(update={"offload_capacity_tokens": offload_tokens})
        config = config.model_copy(update={"kv_tiers": tiers})
    return config


def replay(variant: str, seed: int, args: argparse.Namespace, progs: Sequence[Program]) -> dict[str, Any]:
    """One run: every program and background request through one fresh pool; per-turn results."""
    offload_blocks = getattr(args, "offload_blocks", 0)
    router = build_router(routing_config(variant, args.weight, seed, offload_blocks * 16))
    pool = SimPool(
        router,
        args.replicas,
        preset="llama-3.1-8b@h100",
        kv_blocks=args.kv_blocks,
        max_num_seqs=args.max_num_seqs,
        offload_blocks=offload_blocks,
        offload_bandwidth=getattr(args, "offload_gbps", 25.0) * 1e9,
    )
    shared = shared_ids()
    turns: list[dict[str, Any]] = []
    background_ttfts: list[float] = []

    def start_turn(program: Program, own: list[int], index: int, prev: dict[str, Any] | None) -> None:
        turn = program.session.turns[index]
        prompt = (shared + own)[: turn.prompt_tokens]

        def done(job: Job, now: float) -> None:
            req = job.req
            row = {
                "program": program.name,
                "turn": index,
                "prompt": req.num_prompt,
                "cached": req.num_cached_tokens or 0,
                "ttft_s": (req.first_token_s or now) - job.arrival_s,
                "endpoint": job.decision.endpoint.id,
                "reason": job.decision.reason,
                "after_tool_call": prev is not None and prev["tool_calls"],
                "prev_prompt": prev["prompt"] if prev is not None else 0,
                "same_endpoint": prev is not None and prev["endpoint"] == job.decision.endpoint.id,
                "tool_calls": turn.tool_calls,
                "preemptions": req.num_preemptions,
            }
            turns.append(row)
            if turn.tool_calls:  # what the gateway's ToolBoundary hook does when the answer ends in tool calls
                router.note_tool_call(job.facts, job.decision, req.num_prompt + len(req.output_ids), now)
            if index + 1 < len(program.session.turns):
                pause = turn.gap_s * args.gap_scale
                pool.at(now + pause, lambda: start_turn(program, own, index + 1, row))

        session = program.name if variant == "session" else None
        pool.send(prompt, turn.output_tokens, done, program=program.name, session=session)

    for program in progs:
        own = program.own_ids()
        pool.at(program.start_s, lambda p=program, o=own: start_turn(p, o, 0, None))  # type: ignore[misc]
    horizon = max(p.start_s for p in progs)
    rng = random.Random(seed)
    for at in background(horizon, args.background_rps, seed):

        def one_shot() -> None:
            prompt = [rng.randrange(1, VOCAB) for _ in range(args.background_tokens)]
            pool.send(
                prompt,
                args.background_output,
                lambda job, now: background_ttfts.append((job.req.first_token_s or now) - job.arrival_s),
            )

        pool.at(at, one_shot)
    started = time.perf_counter()
    pool.run(float("inf"))
    return {
        "variant": variant,
        "seed": seed,
        "turns": turns,
        "background_ttfts": background_ttfts,
        "sim_s": pool.now,
        "host_s": time.perf_counter() - started,
        "tool_returns": {"noted": router.tool_returns.noted, "returned": router.tool_returns.returned},
        "learnt_ttl_s": router.tool_returns.learner.ttl_s("agents"),
    }


def _offload_text(args: argparse.Namespace) -> str:
    blocks = getattr(args, "offload_blocks", 0)
    if not blocks:
        return ""
    return (
        f"; a host-DRAM tier of {blocks} blocks = {blocks * 16:,} tokens each at "
        f"{getattr(args, 'offload_gbps', 25.0):g} GB/s, modelled by the router's approximate index too"
    )


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summarize(run: dict[str, Any]) -> dict[str, float]:
    after = [t for t in run["turns"] if t["after_tool_call"]]
    others = [t for t in run["turns"] if t["turn"] > 0 and not t["after_tool_call"]]
    every = run["turns"]

    def hit(rows: list[dict[str, Any]]) -> float:
        possible = sum(min(t["prev_prompt"], t["prompt"]) for t in rows)
        return 100.0 * sum(min(t["cached"], t["prev_prompt"]) for t in rows) / possible if possible else float("nan")

    def own_hit(rows: list[dict[str, Any]]) -> float:
        possible = sum(max(min(t["prev_prompt"], t["prompt"]) - SHARED_TOKENS, 0) for t in rows)
        found = sum(max(min(t["cached"], t["prev_prompt"]) - SHARED_TOKENS, 0) for t in rows)
        return 100.0 * found / possible if possible else float("nan")

    ttfts = [t["ttft_s"] for t in every]
    return {
        "after_tool_turns": len(after),
        "hit_after_tool": hit(after),
        "own_hit_after_tool": own_hit(after),
        "same_endpoint_after_tool": 100.0 * sum(t["same_endpoint"] for t in after) / len(after) if after else 0.0,
        "hit_other_turns": hit(others),
        "ttft_p50_ms": 1000 * _pct(ttfts, 0.5),
        "ttft_p90_ms": 1000 * _pct(ttfts, 0.9),
        "ttft_after_tool_p50_ms": 1000 * _pct([t["ttft_s"] for t in after], 0.5),
        "ttft_after_tool_p90_ms": 1000 * _pct([t["ttft_s"] for t in after], 0.9),
        "background_ttft_p90_ms": 1000 * _pct(run["background_ttfts"], 0.9),
        "preempted_turns": sum(1 for t in every if t["preemptions"]),
        "learnt_ttl_s": run["learnt_ttl_s"],
        "host_s": run["host_s"],
    }


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def render(args: argparse.Namespace, runs: list[dict[str, Any]], png: str) -> str:
    rows = {(r["variant"], r["seed"]): summarize(r) for r in runs}
    seeds = sorted({r["seed"] for r in runs})

    def delta(metric: str, a: str, b: str) -> tuple[float, float]:
        return _mean_sd([rows[a, s][metric] - rows[b, s][metric] for s in seeds])

    d_mean, d_sd = delta("hit_after_tool", "tool-affinity", "default")
    o_mean, o_sd = delta("own_hit_after_tool", "tool-affinity", "default")
    s_mean, s_sd = delta("own_hit_after_tool", "tool-affinity", "session")
    host = platform.processor() or platform.machine()
    met = d_mean >= TARGET_POINTS
    lines = [
        "# Tool-boundary affinity: next-turn prefix hits",
        "",
        f"`python -m bench.tool_affinity {' '.join(args.argv)}`".replace(" `", "`"),
        "",
        f"{args.replicas} simulated Llama-3.1-8B@H100 replicas in process (the simulator's scheduler and paged KV, "
        f"{args.kv_blocks} blocks of 16 tokens = {args.kv_blocks * 16:,} tokens of KV each, max_num_seqs "
        f"{args.max_num_seqs}{_offload_text(args)}), {args.programs} τ²-bench retail programs per seed arriving "
        f"at {args.rate} / s "
        f"(pauses = the trace's start-to-start gaps x {args.gap_scale}), unrelated one-shot prompts of "
        f"{args.background_tokens} tokens at {args.background_rps} / s. Seeds {', '.join(map(str, seeds))}; "
        f"`tool-affinity` weight {args.weight} added to the default pipeline. Host: {host}, "
        "simulated time (no wall clock in the numbers).",
        "",
        "**Next-turn prefix hit rate** (turns that follow a tool-call answer): prompt tokens the engine found "
        "cached / tokens the previous turn left (its prompt). *Own history*: the same without the 5,120 tokens every "
        "program shares (system prompt and tools), which every replica keeps hot.",
        "",
        f"Difference (tool-affinity - default), mean ± sd over seeds: **{d_mean:+.1f} ± {d_sd:.1f} points** "
        f"(own history {o_mean:+.1f} ± {o_sd:.1f}). Target ≥ +{TARGET_POINTS:.0f}: **{'met' if met else 'not met'}**. "
        f"Against session affinity keyed by the program id (`session`): own history {s_mean:+.1f} ± {s_sd:.1f}.",
        "",
        "| variant | seed | turns after a tool call | hit % | own-history hit % | same replica % "
        "| hit % other turns | TTFT p50 / p90 ms (all turns) | after tool p50 / p90 ms | one-shot p90 ms "
        "| preempted turns | learnt TTL s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant in VARIANTS:
        for seed in seeds:
            s = rows[variant, seed]
            lines.append(
                f"| {variant} | {seed} | {s['after_tool_turns']} | {s['hit_after_tool']:.1f} | "
                f"{s['own_hit_after_tool']:.1f} | {s['same_endpoint_after_tool']:.1f} | {s['hit_other_turns']:.1f} | "
                f"{s['ttft_p50_ms']:.0f} / {s['ttft_p90_ms']:.0f} | {s['ttft_after_tool_p50_ms']:.0f} / "
                f"{s['ttft_after_tool_p90_ms']:.0f} | {s['background_ttft_p90_ms']:.0f} | {s['preempted_turns']} | "
                f"{s['learnt_ttl_s']:.1f} |"
            )
    for variant in VARIANTS:
        hits = [rows[variant, s]["hit_after_tool"] for s in seeds]
        p50 = [rows[variant, s]["ttft_p50_ms"] for s in seeds]
        p90 = [rows[variant, s]["ttft_p90_ms"] for s in seeds]
        lines.append(
            f"| **{variant}** | mean | | {statistics.fmean(hits):.1f} ± {_mean_sd(hits)[1]:.1f} | | | | "
            f"{statistics.fmean(p50):.0f} / {statistics.fmean(p90):.0f} | | | | |"
        )
    lines += ["", f"![hit rate and TTFT per seed]({png})", "", *notes.section(args.out)]
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {(r["variant"], r["seed"]): summarize(r) for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    panels = (
        ("hit_after_tool", "next-turn prefix hit % (after a tool call)"),
        ("own_hit_after_tool", "... of the program's own history %"),
        ("ttft_p90_ms", "TTFT p90 ms (all turns)"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 4))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        xs = [j + (i - (len(VARIANTS) - 1) / 2) * width for j in range(len(seeds))]
        for ax, (metric, _) in zip(axes, panels, strict=True):
            ax.bar(xs, [rows[variant, s][metric] for s in seeds], width, label=variant)
    for ax, (_, title) in zip(axes, panels, strict=True):
        ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
        ax.set_title(title)
        ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--programs", type=int, default=240)
    p.add_argument("--rate", type=float, default=1.0, help="programs started per simulated second")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=6000, help="KV blocks of 16 tokens per replica")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--gap-scale", type=float, default=1.0)
    p.add_argument("--background-rps", type=float, default=2.0)
    p.add_argument("--background-tokens", type=int, default=3000)
    p.add_argument("--background-output", type=int, default=100)
    p.add_argument("--weight", type=float, default=2.0)
    p.add_argument("--offload-blocks", type=int, default=0, help="host-DRAM tier per replica, blocks of 16 tokens")
    p.add_argument("--offload-gbps", type=float, default=25.0, help="its PCIe bandwidth per device, GB/s")
    p.add_argument("--quick", action="store_true", help="one seed, 60 programs")
    p.add_argument("--out", type=Path, default=RESULTS / "tool-affinity.md")
    p.add_argument("--report-only", action="store_true", help="re-render the report from its raw file")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    import sys

    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.seeds, args.programs = args.seeds[:1], 60
    if args.report_only:
        raw.rerender(args.out, render, plot)
        return
    sessions = load_sessions(require(TRACES / SESSIONS))
    runs = []
    for seed in args.seeds:
        progs = programs(sessions, args.programs, args.rate, seed)
        for variant in VARIANTS:
            run = replay(variant, seed, args, progs)
            s = summarize(run)
            print(
                f"seed {seed} {variant:14s} hit-after-tool {s['hit_after_tool']:5.1f} % "
                f"own {s['own_hit_after_tool']:5.1f} % same {s['same_endpoint_after_tool']:5.1f} % "
                f"ttft p50/p90 {s['ttft_p50_ms']:.0f}/{s['ttft_p90_ms']:.0f} ms ({run['host_s']:.1f} s host)",
                flush=True,
            )
            runs.append(run)
    written = raw.write(args.out, args, runs, render, plot)
    print(f"wrote {args.out}, {args.out.with_suffix('.png')}, {written}")

"""The chaos benchmark in one command: bounded probes against `tokenway serve` over simulated engines
and a real Redis, each with its target, written to bench/results/chaos.md (and chaos.png).

    .venv/bin/python -m bench.chaos [--only replica_kill,redis,gateway_kill,disconnects,fuzz,memory,
                                            schema_fuzz,checklist,epp_fuzz,upstream_fuzz,engine_channels,
                                            control_fuzz,state_fuzz,resources,disk_fuzz]
                                    [--fuzz-examples 3000] [--memory-requests 50000] [--schema-examples 2000]
                                    [--epp-examples 1500] [--upstream-examples 3000] [--engine-examples 2000]
                                    [--control-examples 1000] [--state-examples 3000]
                                    [--resources-examples 120] [--disk-examples 300] [--seed N]

Every probe starts its own processes on free ports and stops them; nothing is left running. A run of
some probes (`--only`) rewrites their sections of chaos.md and keeps the others' as they were.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.chaos import (
    checklist,
    control_fuzz,
    disconnects,
    disk_fuzz,
    engine_channels,
    epp_fuzz,
    fuzz,
    gateway_kill,
    memory,
    redis_faults,
    replica_kill,
    resources,
    schema_fuzz,
    state_fuzz,
    upstream_fuzz,
)
from bench.chaos.common import RESULTS

PROBES = (
    "replica_kill",
    "redis",
    "gateway_kill",
    "disconnects",
    "fuzz",
    "memory",
    "schema_fuzz",
    "checklist",
    "epp_fuzz",
    "upstream_fuzz",
    "engine_channels",
    "control_fuzz",
    "state_fuzz",
    "resources",
    "disk_fuzz",
)
# How each probe's section of chaos.md begins (and its title, used when the probe failed to run): a run
# of some probes keeps the sections of the others from the file as it was.
HEADINGS = {
    "replica_kill": ("## Engine replica", "engine replica kill -9"),
    "redis": ("## Redis stalls", "Redis stalls and kill -9"),
    "gateway_kill": ("## Gateway `kill -9`", "gateway kill -9"),
    "disconnects": ("## Clients disconnecting", "random disconnects"),
    "fuzz": ("## Fuzzing every endpoint", "fuzzing every endpoint"),
    "memory": ("## Memory:", "memory under hostile client strings"),
    "schema_fuzz": ("## Schema-driven fuzz", "schema-driven fuzz over /openapi.json"),
    "checklist": ("## Per-surface checklist", "per-surface checklist"),
    "epp_fuzz": ("## The endpoint picker's stream", "the endpoint picker's stream (`tokenway epp`)"),
    "upstream_fuzz": ("## An engine that answers anything", "an engine that answers anything"),
    "engine_channels": (
        "## What an engine reports on its side channels",
        "what an engine reports on its side channels",
    ),
    "control_fuzz": (
        "## An identity provider and a cluster API that answer anything",
        "an identity provider and a cluster API that answer anything",
    ),
    "state_fuzz": ("## Shared state that holds anything", "shared state that holds anything"),
    "resources": ("## A host out of disk", "a host out of disk, file descriptors or Redis memory"),
    "disk_fuzz": ("## Files on disk that hold anything", "files on disk that hold anything"),
}


def _previous_sections(path: Path) -> dict[str, list[str]]:
    """The sections of an existing chaos.md, by the probe that wrote each."""
    if not path.exists():
        return {}
    found: dict[str, list[str]] = {}
    current: str | None = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            current = next(
                (p for p, (start, title) in HEADINGS.items() if line.startswith(start) or line == f"## {title}"), None
            )
            if current is not None:
                found[current] = []
        elif line.startswith("# "):
            current = None
        if current is not None:
            found[current].append(line)
    return found


def _ok(good: bool) -> str:
    return "met" if good else "**missed**"


def _plot(samples: list[tuple[int, float]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot([n for n, _ in samples], [mb for _, mb in samples], marker="o")
    ax.set_xlabel("requests (random ids, 100 KB user each)")
    ax.set_ylabel("gateway RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title("Gateway memory under hostile client strings")
    fig.tight_layout()
    fig.savefig(RESULTS / "chaos.png", dpi=110)
    return True


def _section_replica(r: dict[str, Any]) -> list[str]:
    rows = r["rows"]
    lines = [
        "## Engine replica `kill -9` under mixed load",
        "",
        f"{r['rate_per_s']:g} requests/s for {r['duration_s']:g} s over two engines, half streamed; one engine "
        f"is killed {r['kill_at_s']:g} s in.",
        "",
        "| kind | sent | failed | why |",
        "| --- | ---: | ---: | --- |",
    ]
    for kind, row in rows.items():
        why = ", ".join(f"{k}: {v}" for k, v in row["reasons"].items()) or "-"
        lines.append(f"| {kind} | {row['sent']} | {row['failed']} | {why} |")
    unary = rows["non-streamed"]["failed"]
    lines += [
        "",
        f"Target 0 non-streamed failures: {_ok(unary == 0)} ({unary}). Leases left after the load: "
        f"{r['leases_left']}, in-flight counts left: {r['inflight_left']}. Streams relaying tokens from the "
        "killed engine cannot move (their clients hold part of an answer): they end with an error event.",
        "",
    ]
    return lines


def _section_redis(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Redis stalls (`SIGSTOP` 0.5 s x 5) and `kill -9` under load",
        "",
        "60 requests/s; the limiter's Redis (append-only file, fsync always) is stopped five times for 0.5 s, "
        "then killed and restarted. Afterwards: what Redis still holds, and the budget it kept against the "
        "ledger's sum of `cost_usd`.",
        "",
        "| policy | faults | sent | served | not served (why) | tickets left | leases left | budget - ledger (USD) |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    met = True
    for r in results:
        why = ", ".join(f"{k}: {v}" for k, v in r["failed"].items()) or "-"
        diff = r["budget_usd"] - r["ledger_usd"]
        met = met and r["tickets_left"] == 0 and r["leases_left"] == 0 and abs(diff) < 1e-9
        lines.append(
            f"| {r['store_failure']} | {', '.join(r['faults'])} | {r['sent']} | {r['served']} | {why} | "
            f"{r['tickets_left']} | {r['leases_left']} | {diff:+.3g} |"
        )
    lines += ["", f"Targets 0 leaked reservations and budget - ledger = 0: {_ok(met)}.", ""]
    return lines


def _section_gateway_kill(r: dict[str, Any]) -> list[str]:
    lost = r["lost_before_last_interval"]
    return [
        "## Gateway `kill -9` under load",
        "",
        f"{r['sent']} requests sent, {r['complete']} answered before the kill; ledger commit interval "
        f"{r['commit_interval_ms']} ms.",
        "",
        "| answered | records lost |",
        "| --- | ---: |",
        f"| more than one commit interval before the kill ({r['complete_before_last_interval']}) | {lost} |",
        f"| within the last interval ({r['complete_in_last_interval']}) | {r['lost_in_last_interval']} |",
        "",
        "Target 0 records lost for requests completed more than one commit interval before the kill: "
        f"{_ok(lost == 0)}.",
        "",
    ]


def _section_disconnects(r: dict[str, Any]) -> list[str]:
    ok = (
        r["leases_left"] == 0
        and r["inflight_left"] == 0
        and r["missing_records"] == 0
        and r["duplicate_records"] == 0
        and r["internal_errors"] == 0
    )
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(r["outcomes"].items()))
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
    return [
        "## Clients disconnecting at random points (PD prefill leg included)",
        "",
        f"{r['clients']} clients on a prefill/decode pool at real time, each giving up after 0-3 s "
        f"({outcomes}); the prefill engine saw {r['prefill_legs']} prefill legs (finished or aborted).",
        "",
        "| leases left | in-flight left | requests without a record | with two | 500s in the log |",
        "| ---: | ---: | ---: | ---: | ---: |",
        f"| {r['leases_left']} | {r['inflight_left']} | {r['missing_records']} | {r['duplicate_records']} | "
        f"{r['internal_errors']} |",
        "",
        f"Records by status: {statuses}. Target nothing held, one record per request: {_ok(ok)}.",
        "",
    ]


def _section_fuzz(r: dict[str, Any]) -> list[str]:
    statuses = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
    lines = [
        "## Fuzzing every endpoint (hypothesis)",
        "",
        f"{r['examples']} generated requests{schema_fuzz.seeded(r)} in {r['seconds']:g} s. "
        f"Answers by status: {statuses}.",
        "",
        f"Target 0 5xx: {_ok(r['server_errors'] == 0)} ({r['server_errors']}; unexpected errors in the gateway's "
        f"log: {r['unexpected_in_log']}).",
        "",
    ]
    for example in r["server_error_examples"]:
        lines += [f"    {example}"]
    if r["server_error_examples"]:
        lines.append("")
    return lines


def _section_memory(r: dict[str, Any], plotted: bool) -> list[str]:
    curve = ", ".join(f"{n:,}: {mb:.0f}" for n, mb in r["samples"])
    return [
        "## Memory: 50,000 requests with random ids and 100 KB `user` values",
        "",
        f"{r['requests']:,} requests (random 64-character `x-request-id`, random `x-session-id`, 100 KB `user`) "
        f"in {r['seconds']:g} s; statuses {r['statuses']}.",
        "",
        "| RSS after warm-up (MiB) | after (MiB) | growth (MiB) | growth over the second half (MiB) |",
        "| ---: | ---: | ---: | ---: |",
        f"| {r['rss_start_mb']:.1f} | {r['rss_end_mb']:.1f} | {r['growth_mb']:+.1f} | "
        f"{r['growth_second_half_mb']:+.1f} |",
        "",
        f"RSS by requests sent (MiB): {curve}." + (" ![RSS](chaos.png)" if plotted else ""),
        "",
        "Bound: the session table holds at most `routing.session.max_sessions` (100,000) keys of at most 64 "
        "characters (longer ones are kept as a 32-character hash), so session keys cannot account for more "
        "than about 20 MiB whatever clients send; request ids and `user` values are not kept past the request. "
        f"Target growth within that bound: {_ok(r['growth_mb'] < 40)}.",
        "",
    ]


def _stage(module: ModuleType, folder: Path, examples: int, seed: int | None) -> list[str]:
    """One hypothesis-driven stage's section (the checklist draws nothing: it runs whole)."""
    result = module.run(folder) if module is checklist else module.run(folder, examples=examples, seed=seed)
    lines: list[str] = module.section(result)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PROBES), help="comma-separated probes to run")
    parser.add_argument("--fuzz-examples", type=int, default=3000)
    parser.add_argument("--memory-requests", type=int, default=50_000)
    parser.add_argument("--schema-examples", type=int, default=2000)
    parser.add_argument("--epp-examples", type=int, default=1500)
    parser.add_argument("--upstream-examples", type=int, default=3000)
    parser.add_argument("--engine-examples", type=int, default=2000)
    parser.add_argument("--control-examples", type=int, default=1000)
    parser.add_argument("--state-examples", type=int, default=3000)
    parser.add_argument("--disk-examples", type=int, default=300)  # each restarts the gateway: ~4 s
    parser.add_argument("--resources-examples", type=int, default=120)
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="draw the fuzz stages' examples from this seed (default: the fixed sequence)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the probes' working directories")
    args = parser.parse_args()
    chosen = [p.strip() for p in args.only.split(",") if p.strip()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tokenway-chaos-"))
    started = time.time()
    previous = _previous_sections(RESULTS / "chaos.md")
    done: dict[str, list[str]] = {}

    def write() -> None:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
        host = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        header = [
            "# Chaos: the gateway's promises under faults and hostile input",
            "",
            f"Generated by `python -m bench.chaos` on {when} ({host}; load average {os.getloadavg()[0]:.1f} when "
            "written: the machine is shared, so rates and times vary between runs). Real processes throughout: "
            "`tokenway serve`, simulated engines (`sim`), redis-server; faults are real signals.",
            "",
        ]
        sections: list[str] = []
        for name in PROBES:
            kept = done.get(name, previous.get(name, []))
            sections.extend(kept if not kept or kept[-1] == "" else [*kept, ""])
        (RESULTS / "chaos.md").write_text("\n".join(header + sections))

    def probe(name: str, title: str, work: Callable[[], list[str]]) -> None:
        if name not in chosen:
            return
        print(f"chaos: {title} ...", flush=True)
        try:
            done[name] = work()
        except Exception as exc:  # a probe that cannot run is reported, and the others still run
            done[name] = [f"## {title}", "", f"**The probe failed to run**: `{type(exc).__name__}: {exc}`", ""]
        write()

    def redis_probe() -> list[str]:
        return _section_redis([redis_faults.run(root / f"redis-{p}", p) for p in ("fail_open", "fail_closed")])

    def memory_probe() -> list[str]:
        result = memory.run(root / "memory", total=args.memory_requests)
        return _section_memory(result, _plot(result["samples"]))

    try:
        probe("replica_kill", "engine replica kill -9", lambda: _section_replica(replica_kill.run(root / "replica")))
        probe("redis", "Redis stalls and kill -9", redis_probe)
        probe("gateway_kill", "gateway kill -9", lambda: _section_gateway_kill(gateway_kill.run(root / "gwkill")))
        probe("disconnects", "random disconnects", lambda: _section_disconnects(disconnects.run(root / "disc")))
        probe(
            "fuzz",
            "fuzzing every endpoint",
            lambda: _section_fuzz(fuzz.run(root / "fuzz", examples=args.fuzz_examples, seed=args.seed)),
        )
        probe("memory", "memory under hostile client strings", memory_probe)
        # the hypothesis-driven stages: `run(folder, examples=, seed=)` and `section(result)` each
        stages: tuple[tuple[str, ModuleType, str, int], ...] = (
            ("schema_fuzz", schema_fuzz, "schema", args.schema_examples),
            ("checklist", checklist, "checklist", 0),
            ("epp_fuzz", epp_fuzz, "epp", args.epp_examples),
            ("upstream_fuzz", upstream_fuzz, "upstream", args.upstream_examples),
            ("engine_channels", engine_channels, "engine", args.engine_examples),
            ("control_fuzz", control_fuzz, "control", args.control_examples),
            ("state_fuzz", state_fuzz, "state", args.state_examples),
            ("resources", resources, "resources", args.resources_examples),
            ("disk_fuzz", disk_fuzz, "disk", args.disk_examples),
        )
        for name, module, folder, examples in stages:
            probe(name, HEADINGS[name][1], partial(_stage, module, root / folder, examples, args.seed))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {RESULTS / 'chaos.md'} ({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

"""Side by side: overhead runs of two trees (before / after a change), read from the markdown each run
wrote, as ratios to the same run's bare aiohttp pass-through (this VM's speed varies between runs;
the ratio within one run does not, much).

    .venv/bin/python -m bench.overhead.compare --before B1.md B2.md --after A1.md A2.md \
        --title "..." --out bench/results/overhead-walk.md
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

BARE = "bare aiohttp pass-through"
SEQUENTIAL = "one request at a time"


def _rows(text: str) -> tuple[dict[tuple[str, int], tuple[float, float]], dict[str, float]]:
    """Closed-loop (target, conns) -> (RPS vs bare, CPU µs per request); sequential target -> added p50 ms."""
    closed: dict[tuple[str, int], tuple[float, float]] = {}
    sequential: dict[str, float] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line
        if not line.startswith("| ") or line.startswith("| ---") or line.startswith("| target"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10:  # closed loop
            vs_bare = 1.0 if cells[0] == BARE else float(cells[7]) if cells[7] not in ("-", "") else float("nan")
            cpu = float(cells[8]) if cells[8] not in ("nan", "-") else float("nan")
            closed[(cells[0], int(cells[1]))] = (vs_bare, cpu)
        elif len(cells) == 6 and SEQUENTIAL in section:
            sequential[cells[0]] = float(cells[4])
    return closed, sequential


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", nargs="+", required=True)
    parser.add_argument("--after", nargs="+", required=True)
    parser.add_argument("--title", default="Gateway overhead: before and after")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = {
        "before": [_rows(Path(p).read_text()) for p in args.before],
        "after": [_rows(Path(p).read_text()) for p in args.after],
    }
    closed: dict[str, dict[tuple[str, int], list[tuple[float, float]]]] = {k: defaultdict(list) for k in runs}
    sequential: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in runs}
    for side, parsed in runs.items():
        for rows, seq in parsed:
            for key, value in rows.items():
                closed[side][key].append(value)
            for target, added in seq.items():
                sequential[side][target].append(added)
    keys = sorted({k for side in closed.values() for k in side if k[0] != BARE and not k[0].startswith("direct")})
    lines = [f"# {args.title}", ""]
    if args.note:
        lines += [args.note, ""]
    lines += [
        f"{len(args.before)} run(s) of each tree, alternating; each cell is the mean over its runs. RPS is the "
        "ratio to the same run's bare aiohttp pass-through at the same connection count; CPU is the proxy "
        "process's µs per request; the last columns are the added p50 of one request at a time (sequential "
        "probe, ms).",
        "",
        "| target | conns | RPS vs bare, before | after | after / before | CPU µs/req before | after |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for target, conns in keys:
        before = closed["before"].get((target, conns), [])
        after = closed["after"].get((target, conns), [])
        b_rps, a_rps = _mean([v[0] for v in before]), _mean([v[0] for v in after])
        b_cpu, a_cpu = _mean([v[1] for v in before]), _mean([v[1] for v in after])
        lines.append(
            f"| {target} | {conns} | {b_rps:.2f} | {a_rps:.2f} | {a_rps / b_rps:.2f} | {b_cpu:.0f} | {a_cpu:.0f} |"
        )
    lines += [
        "",
        "| target (sequential probe) | added p50 ms, before | after | after - before |",
        "| --- | ---: | ---: | ---: |",
    ]
    targets = sorted({t for side in sequential.values() for t in side if not t.startswith("direct")})
    for target in targets:
        b, a = _mean(sequential["before"].get(target, [])), _mean(sequential["after"].get(target, []))
        lines.append(f"| {target} | {b:.3f} | {a:.3f} | {a - b:+.3f} |")
    lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

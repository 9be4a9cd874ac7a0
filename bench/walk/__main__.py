"""The walk of one request through the gateway, before and after issue 40's refactor, side by side.

Issue 40 measures its refactor by the walk of one streamed chat completion: how many production
modules and functions it passes through and how often control comes back to a module it left (a
feature spread across the walk shows as returns to `dispatch.py`). This runs `bench/walk/tracer.py`
(the method is in its docstring) once against each tree, in a process of its own whose imports come
from that tree, and writes the two columns:

    mkdir -p /tmp/walk-before && git archive 42b8d84 | tar -x -C /tmp/walk-before
    .venv/bin/python -m bench.walk --before /tmp/walk-before

Writes bench/results/walk.md and walk.png. The "after" tree is this checkout unless `--after` names
another; without `--before` the before column says it was not run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.walk.tracer import room_of

REPO = Path(__file__).resolve().parents[2]
TRACER = Path(__file__).resolve().with_name("tracer.py")
RESULTS = REPO / "bench" / "results"
BEFORE_COMMIT = "42b8d84"  # main before issue 40's refactor
DISPATCH = "gateway/request/dispatch.py"  # the before tree's dispatch
DISPATCH_AFTER = "gateway/request/director.py"  # where dispatch lives now (merged with the director)
HEADLINE = "chat, streamed"
ROOMS = ("gateway", "policies", "predictor", "backends", "sim")
TARGET_WALK_MODULES = 50  # issue 40: a streamed chat request's walk
TARGET_TREE_MODULES = 240  # issue 40: production modules, __init__.py included


@dataclass
class Tree:
    """One traced tree: its label and tracer.py's report, or why there is none."""

    label: str
    report: dict[str, Any] | None
    problem: str = ""

    def runs(self, kind: str) -> list[dict[str, Any]]:
        if self.report is None:
            return []
        runs: list[dict[str, Any]] = self.report["requests"].get(kind, {}).get("runs", [])
        return runs

    def median(self, kind: str, key: str) -> float | None:
        values = [run[key] for run in self.runs(kind)]
        return statistics.median(values) if values else None

    def module_returns(self, kind: str, module: str) -> float | None:
        values = [run["modules"].get(module, {}).get("returns", 0) for run in self.runs(kind)]
        return statistics.median(values) if values else None

    def typical(self, kind: str) -> dict[str, Any] | None:
        """The run whose function count is the median one: its module list stands for the kind."""
        runs = sorted(self.runs(kind), key=lambda run: run["function_count"])
        return runs[len(runs) // 2] if runs else None

    def tree_modules(self, without_init: bool = False) -> int | None:
        if self.report is None:
            return None
        key = "without_init" if without_init else "all"
        return sum(int(counts[key]) for counts in self.report["production_modules"].values())


def trace(root: Path, label: str, extra: list[str]) -> Tree:
    """tracer.py against `root`, in a process of its own (its imports are that tree's)."""
    argv = [sys.executable, str(TRACER), "--root", str(root), *extra]
    print(f"tracing {label}: {' '.join(argv)}", file=sys.stderr, flush=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        return Tree(label, None, f"tracer.py exited {done.returncode}: " + " / ".join(tail))
    report: dict[str, Any] = json.loads(done.stdout)
    return Tree(label, report)


def tree_label(root: Path) -> str:
    """The checkout's commit, and whether files differ from it (the lead commits at the end)."""
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return str(root)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True)
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:g}"


def _span(tree: Tree, kind: str, key: str) -> str:
    """The median, with the range over the traced requests when they differ."""
    values = [run[key] for run in tree.runs(kind)]
    if not values:
        return "-"
    low, high, mid = min(values), max(values), statistics.median(values)
    return _num(mid) if low == high else f"{_num(mid)} ({low}-{high})"


def render(before: Tree, after: Tree) -> str:
    ref = after.report or before.report or {}
    kinds = list(ref.get("requests", {})) or [HEADLINE]
    lines = [
        "# The walk of one request, before and after issue 40",
        "",
        f"Before: {before.label}. After: {after.label}. Python {ref.get('python', '?')}; each request asks "
        f"for {ref.get('max_tokens', '?')} tokens of `llama-3.1-8b`; {ref.get('warm_ups', '?')} untraced "
        "requests of each kind, then each kind traced on its own (each cell: the median over the traced "
        "requests, the range in brackets where they differ). Made by `python -m bench.walk` "
        "(how to rerun it: below).",
        "",
    ]
    for tree in (before, after):
        if tree.problem:
            lines += [f"**{tree.label}: not measured**: {tree.problem}", ""]
    lines += [
        "| request | modules, before | after | functions, before | after | returns to the same module, before "
        f"| after | of them to `{DISPATCH.rsplit('/', 1)[-1]}`, before "
        f"| after (`{DISPATCH_AFTER.rsplit('/', 1)[-1]}`) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in kinds:
        name = f"**{kind}** (headline)" if kind == HEADLINE else kind
        cells = [name]
        for key in ("module_count", "function_count", "returns"):
            cells += [_span(before, kind, key), _span(after, kind, key)]
        cells += [_num(before.module_returns(kind, DISPATCH)), _num(after.module_returns(kind, DISPATCH_AFTER))]
        lines.append("| " + " | ".join(cells) + " |")
    walk_verdict = _verdict(
        before.median(HEADLINE, "module_count"), after.median(HEADLINE, "module_count"), TARGET_WALK_MODULES
    )
    tree_verdict = _verdict(before.tree_modules(), after.tree_modules(), TARGET_TREE_MODULES)
    lines += [
        "",
        "| production modules in the tree | before | after |",
        "| --- | ---: | ---: |",
        f"| **`*.py` files, `__init__.py` included** (headline) | {_num(before.tree_modules())} "
        f"| {_num(after.tree_modules())} |",
        f"| without `__init__.py` | {_num(before.tree_modules(True))} | {_num(after.tree_modules(True))} |",
        "",
        f"Issue 40's targets: at most {TARGET_WALK_MODULES} modules on a streamed chat request's walk "
        f"({walk_verdict}); at most {TARGET_TREE_MODULES} production modules ({tree_verdict}).",
        "",
        "Per room (top-level package; `sim/` is the simulated engine, `backends/sim/` before it moved):",
        "",
        "| room | modules on the streamed chat walk, before | after | modules in the tree, before | after |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    rooms_before, rooms_after = _walk_heights(before), _walk_heights(after)
    for index, room in enumerate(ROOMS):
        walk_before = rooms_before[index] if before.report is not None else None
        walk_after = rooms_after[index] if after.report is not None else None
        lines.append(
            f"| `{room}/` | {_num(walk_before)} | {_num(walk_after)} "
            f"| {_num(_tree_room(before, room))} | {_num(_tree_room(after, room))} |"
        )
    lines += [
        "",
        "![modules per room, before and after](walk.png)",
        "",
        "Returns counting the passes of an await (a coroutine suspended and resumed passes control up "
        "through every awaiting frame and back down; the table above leaves those out):",
        "",
        "| request | before | after |",
        "| --- | ---: | ---: |",
    ]
    for kind in kinds:
        lines.append(
            f"| {kind} | {_span(before, kind, 'returns_with_awaits')} | {_span(after, kind, 'returns_with_awaits')} |"
        )
    lines += ["", *_method(), ""]
    for tree, which in ((before, "before"), (after, "after")):
        lines += _module_table(tree, which)
    return "\n".join(lines).rstrip() + "\n"


def _verdict(before: float | None, after: float | None, target: int) -> str:
    parts = []
    for name, value in (("before", before), ("after", after)):
        if value is not None:
            parts.append(f"{name} {_num(value)}, {'met' if value <= target else 'not met'}")
    return "; ".join(parts) or "not measured"


def _rooms(tree: Tree) -> dict[str, int]:
    run = tree.typical(HEADLINE)
    counts: dict[str, int] = {}
    for module in run["modules"] if run else {}:
        room = room_of(module)
        counts[room] = counts.get(room, 0) + 1
    return counts


def _tree_room(tree: Tree, room: str) -> int | None:
    if tree.report is None:
        return None
    counts = tree.report["production_modules"].get(room)
    return int(counts["all"]) if counts else 0


def _method() -> list[str]:
    return [
        "## What was traced",
        "",
        "One gateway process per tree, built in process the way `tokenway serve` builds it (the tree's app "
        "factory and runner) from the tree's `config/gateway.yaml`, the embedded default: simulated engine "
        "pools launched and supervised by the gateway (subprocesses, not traced), in-memory state. After "
        "every endpoint is ready and the warm-up requests, each traced request runs on a connection of its "
        "own. A `sys.setprofile` function counts the calls of functions of production modules (`.py` files "
        "under `gateway/`, `policies/`, `predictor/`, `backends/`, `sim/`) made by the request's task and "
        "the tasks it starts, from the app's first middleware until the last byte is written and those "
        "tasks have ended; the gateway's background loops (health probes, scrapes, flow control's ticks) "
        "run in other tasks and are left out. The upstream connection's transport callbacks, which run in "
        "no task, are counted for the request's own connection only. It runs on asyncio's own event loop "
        "(`tokenway serve` runs uvloop: third-party code, not counted either way) and traces the loop's "
        "thread only.",
        "",
        "- **modules**: production modules with at least one function called;",
        "- **functions**: distinct functions called (list, set and dict comprehensions left out: Python "
        "3.12 inlines them into their function; lambdas and generator expressions counted);",
        "- **returns to the same module**: in the sequence of production modules control is in (third-party "
        "code in between does not count as leaving), each time a module comes back after control left it "
        "for another production module: `dispatch → relay → dispatch` is one return to `dispatch.py`. "
        "Streamed requests pass through the relay and the upstream client once per chunk, so this figure "
        "grows with the tokens asked for; compare it only at the same `--max-tokens`.",
        "",
        "Issue 40 quotes 84 modules, about 307 functions and 20 returns to `dispatch.py` for the before "
        "tree, counted by a method it does not describe; the figures here are this method's, on both trees.",
        "",
        "## Rerun",
        "",
        "```sh",
        f"mkdir -p /tmp/walk-before && git archive {BEFORE_COMMIT} | tar -x -C /tmp/walk-before",
        ".venv/bin/python -m bench.walk --before /tmp/walk-before   # about a minute; writes walk.md and walk.png",
        "```",
        "",
        "`--max-tokens`, `--warm-ups` and `--repeats` are passed to `bench/walk/tracer.py`, which also runs "
        "alone: `.venv/bin/python bench/walk/tracer.py --root TREE` prints one tree's report as JSON (every "
        "module with the functions it had called, per traced request).",
        "",
    ]


def _module_table(tree: Tree, which: str) -> list[str]:
    run = tree.typical(HEADLINE)
    if run is None:
        return []
    modules: dict[str, dict[str, Any]] = run["modules"]
    lines = [
        f"## The streamed chat request's modules, {which}: {tree.label}",
        "",
        f"{len(modules)} modules, {run['function_count']} functions (the traced request whose function count "
        "is the median).",
        "",
        "| module | functions | calls | returns to it |",
        "| --- | ---: | ---: | ---: |",
    ]
    for module in sorted(modules):
        info = modules[module]
        lines.append(f"| `{module}` | {len(info['functions'])} | {info['calls']} | {info['returns']} |")
    return [*lines, ""]


def _walk_total(tree: Tree) -> float | None:
    return tree.median(HEADLINE, "module_count")


def _totals(before: Tree, after: Tree, total: Callable[[Tree], float | None]) -> str:
    return f"in all: {_num(total(before))} before, {_num(total(after))} after"


def _walk_heights(tree: Tree) -> list[int]:
    rooms = _rooms(tree)
    return [rooms.get(room, 0) for room in ROOMS]


def _tree_heights(tree: Tree) -> list[int]:
    return [_tree_room(tree, room) or 0 for room in ROOMS]


def plot(before: Tree, after: Tree, path: Path) -> bool:
    """Modules per room, before and after: on the streamed chat walk, and in the tree."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.38
    xs = range(len(ROOMS))
    panels: tuple[tuple[str, Callable[[Tree], list[int]]], ...] = (
        (
            f"modules on a streamed chat request's walk\n({_totals(before, after, _walk_total)}; "
            f"target {TARGET_WALK_MODULES})",
            _walk_heights,
        ),
        (
            f"production modules in the tree\n({_totals(before, after, Tree.tree_modules)}; "
            f"target {TARGET_TREE_MODULES})",
            _tree_heights,
        ),
    )
    for axis, (title, heights_of) in zip(axes, panels, strict=True):
        for offset, tree, name in ((-width / 2, before, "before"), (width / 2, after, "after")):
            if tree.report is None:
                continue
            heights = heights_of(tree)
            bars = axis.bar([x + offset for x in xs], heights, width, label=f"{name}: {tree.label}")
            axis.bar_label(bars, fontsize=8)
        axis.set_xticks(list(xs), [f"{room}/" for room in ROOMS])
        axis.set_title(title, fontsize=9)
        axis.set_ylabel("modules")
    axes[0].legend(fontsize=8)
    fig.suptitle("The walk of one request, per room: before and after issue 40", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description="The request walk before and after issue 40.")
    parser.add_argument("--before", type=Path, help=f"the tree before (e.g. `git archive {BEFORE_COMMIT}` unpacked)")
    parser.add_argument("--before-label", default=f"{BEFORE_COMMIT} (before issue 40)")
    parser.add_argument("--after", type=Path, default=REPO, help="the tree after (default: this checkout)")
    parser.add_argument("--after-label", help="default: the checkout's commit")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warm-ups", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "walk.md")
    args = parser.parse_args()
    extra = ["--max-tokens", str(args.max_tokens), "--warm-ups", str(args.warm_ups), "--repeats", str(args.repeats)]
    if args.before is not None:
        before = trace(args.before, args.before_label, extra)
    else:
        before = Tree(args.before_label, None, "no --before tree given")
    after = trace(args.after, args.after_label or tree_label(args.after), extra)
    args.out.write_text(render(before, after))
    print(f"wrote {args.out}", file=sys.stderr)
    png = args.out.with_suffix(".png")
    if plot(before, after, png):
        print(f"wrote {png}", file=sys.stderr)
    return 0 if before.report is not None or after.report is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())

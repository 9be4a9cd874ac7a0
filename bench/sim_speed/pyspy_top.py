"""Summarise a py-spy raw (collapsed) profile: the functions with the most self and total samples.

.venv/bin/python -m bench.sim_speed.pyspy_top prof.txt [--top 30] [--filter sim]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r"\s*\(([^)]*?)(?::\d+)?\)$")


def _function(frame: str) -> str:
    """`name (file:line)` -> `name (file)`: lines of one function are pooled."""
    return _LINE.sub(lambda m: f" ({m.group(1)})", frame)


def summarize(path: Path) -> tuple[Counter[str], Counter[str], int]:
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_function(f) for f in stack.split(";")]
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    return own, total, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--filter", default="", help="only functions whose name or file contains this")
    args = parser.parse_args()
    own, total, samples = summarize(args.profile)
    for title, counter in (("self", own), ("total", total)):
        print(f"--- {title} ({samples} samples)")
        shown = [(f, n) for f, n in counter.most_common() if args.filter in f][: args.top]
        for function, count in shown:
            print(f"{100 * count / samples:6.1f}%  {function}")


if __name__ == "__main__":
    main()

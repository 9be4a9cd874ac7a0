"""Where the benchmarks find the public traces (tests never read them: they stay self-contained).

One rule for every benchmark: `$TOKENWAY_TRACES` when set, else `shared/data/traces` beside the
checkout. A benchmark names the file it needs; a missing one stops it with the path and the variable.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def traces_dir() -> Path:
    env = os.environ.get("TOKENWAY_TRACES")
    return Path(env) if env else (REPO.parent / "shared" / "data" / "traces").resolve()


TRACES = traces_dir()


def require(path: Path) -> Path:
    """`path`, or stop the benchmark naming it and how to point at the traces."""
    if not path.exists():
        raise SystemExit(f"trace missing: {path} (set TOKENWAY_TRACES to the folder of public traces)")
    return path

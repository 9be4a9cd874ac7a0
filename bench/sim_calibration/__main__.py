"""python -m bench.sim_calibration [--fit] [--write-presets]: see __init__.py."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bench.sim_calibration import fit, report, sources

REPO = Path(__file__).resolve().parents[2]
PRESETS_PY = REPO / "backends" / "perf" / "presets.py"
VARIABLES = {"a100": "_EFF_A100", "h100": "_EFF_H100", "h100-pcap": "_EFF_H100_PCAP", "h200": "_EFF_H200"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_calibration")
    parser.add_argument("--fit", action="store_true", help="fit the efficiency factors")
    parser.add_argument("--write-presets", action="store_true", help="paste the fit into presets.py")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)

    traces = sources.traces_dir(REPO)
    if not (traces / "splitwise_sim" / "perf_model.csv").exists():
        print(
            f"calibration data missing: expected {traces} (the shared traces folder beside the repo)", file=sys.stderr
        )
        return 2
    rows = sources.splitwise_rows(traces) + sources.distserve_rows(traces)
    try:
        from bench.sim_calibration.kernels import aiconfigurator_rows

        rows += aiconfigurator_rows(traces)
    except (ImportError, FileNotFoundError) as exc:
        print(f"skipping the aiconfigurator kernel sums: {exc}", file=sys.stderr)

    fitted = fit.fit_all(rows, overheads_from={"h200": "h100"}) if args.fit else None
    if fitted is not None:
        block = "\n".join(fit.python_literal(VARIABLES[hw], eff) for hw, eff in sorted(fitted.items()))
        print(block)
        if args.write_presets:
            text = PRESETS_PY.read_text()
            new = re.sub(
                r"(# BEGIN FITTED EFFICIENCY\n).*?(# END FITTED EFFICIENCY)",
                lambda m: m[1] + block + "\n" + m[2],
                text,
                flags=re.S,
            )
            PRESETS_PY.write_text(new)
            print(f"wrote {PRESETS_PY.relative_to(REPO)}")
    scored = fit.score(rows, fitted)
    markdown, plot = report.write(scored, args.out, fitted)
    print(f"wrote {markdown.relative_to(REPO)} and {plot.relative_to(REPO)}")
    summary = report.pooled(scored)
    for kind, (n, median) in summary.items():
        print(f"{kind}: {n} rows, median absolute error {median:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

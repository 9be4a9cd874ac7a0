"""python -m bench.sim_calibration [--fit] [--write-presets]: see __init__.py."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from backends.perf.hardware import HARDWARE, Efficiency
from bench.sim_calibration import fit, report, serving, sources
from bench.traces import traces_dir

REPO = Path(__file__).resolve().parents[2]
HARDWARE_PY = REPO / "backends" / "perf" / "hardware.py"  # holds the fitted block
# every variable of the fitted block, by hardware (the block is rewritten whole)
VARIABLES = {
    "a100": "_EFF_A100",
    "h100": "_EFF_H100",
    "h100-pcap": "_EFF_H100_PCAP",
    "h200": "_EFF_H200",
    "h20": "_EFF_H20",
    "ascend-910b": "_EFF_ASCEND_910B",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_calibration")
    parser.add_argument("--fit", action="store_true", help="fit the serving factors to the public runs")
    parser.add_argument("--write-presets", action="store_true", help="paste the fit into backends/perf/hardware.py")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)

    traces = traces_dir()
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

    fitted = serving.fit_all() if args.fit else None
    if fitted is not None:
        current: dict[str, Efficiency] = {hw: spec.efficiency for hw, spec in HARDWARE.items()}
        block = "\n".join(
            fit.python_literal(variable, fitted.get(hw, current[hw])) for hw, variable in VARIABLES.items()
        )
        print(block)
        if args.write_presets:
            text = HARDWARE_PY.read_text()
            new = re.sub(
                r"(# BEGIN FITTED EFFICIENCY\n).*?(# END FITTED EFFICIENCY)",
                lambda m: m[1] + block + "\n" + m[2],
                text,
                flags=re.S,
            )
            HARDWARE_PY.write_text(new)
            subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(HARDWARE_PY)], check=False)
            print(f"wrote {HARDWARE_PY.relative_to(REPO)}")
    checked = serving.check_all(fitted)
    scored = fit.score(rows, fitted)
    markdown, plot = report.write(checked, scored, args.out, fitted)
    print(f"wrote {markdown.relative_to(REPO)} and {plot.relative_to(REPO)}")
    target = [c for c in checked if not c.excluded]
    within = sum(abs(c.error) <= report.TARGET for c in target)
    print(f"public serving runs: {within} of {len(target)} fitted metrics within {report.TARGET:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every benchmark runs as `python -m bench.NAME` and answers `--help` (issue 40: one way to run each)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
BENCHMARKS = sorted(p.name for p in BENCH.iterdir() if (p / "__init__.py").is_file())


def test_every_benchmark_folder_has_a_main_module() -> None:
    missing = [name for name in BENCHMARKS if not (BENCH / name / "__main__.py").is_file()]
    assert BENCHMARKS and not missing, f"bench folders without __main__.py: {missing}"


@pytest.mark.parametrize("name", BENCHMARKS)
@pytest.mark.slow
def test_python_m_bench_name_help_prints_its_usage(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [f"bench.{name}", "--help"])
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # what an entry point sets for its children goes
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    assert exited.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out

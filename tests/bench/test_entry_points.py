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


def test_no_benchmark_module_shadows_the_standard_library() -> None:
    """A benchmark module named like a standard-library one (`tokenize.py`) breaks every script started
    by path from its folder: Python puts the folder first on `sys.path`, and `import asyncio` then
    imports it (the bare pass-through of `bench.overhead.run` failed so until it ran as a module)."""
    shadowing = sorted(
        str(path.relative_to(BENCH)) for path in BENCH.rglob("*.py") if path.stem in sys.stdlib_module_names
    )
    assert not shadowing, f"bench modules named like standard-library modules: {shadowing}"

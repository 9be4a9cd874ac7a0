"""The autoscale benchmark's SLO check counts every wait inside the gateway, not only the engine's."""

from __future__ import annotations

from pathlib import Path

from bench.autoscale.client import Outcome
from bench.autoscale.report import honest_ttft_s, met_engine
from bench.autoscale.run import old_extras


def served(**fields: float) -> Outcome:
    out = Outcome(0, "m", 0.0, 100, 10, status=200, finish="length", ttft_s=3.0, completion_tokens=10)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def test_the_flow_queue_counts_towards_ttft() -> None:
    # the engine saw 0.5 simulated s (1 wall s at half speed); the request waited 1.5 s in the
    # gateway's flow queue first: 2.5 s, over a 2 s objective
    queued = served(engine_ttft_s=0.5, engine_tpot_s=0.01, queued_ms=1500.0)
    assert honest_ttft_s(queued, 0.5) == 2.5
    assert not met_engine(queued, 2.0, 0.06, 0.5)
    assert met_engine(queued, 2.0, 0.06, 0.5, queue=False)  # what earlier runs counted
    held = served(engine_ttft_s=0.5, engine_tpot_s=0.01, cold_start_ms=800.0, queued_ms=300.0)
    assert honest_ttft_s(held, 0.5) == 2.1


def test_extras_carry_over_from_an_earlier_report(tmp_path: Path) -> None:
    report = tmp_path / "autoscale.md"
    report.write_text(
        "# Elastic pools\n\nThe three short experiments below are those of the run of 2026-12-01 21:21 UTC "
        "(not re-run).\n\n## A replica killed (`kill -9`) under streaming load\n\n| on | 120 | 0 |\n\n"
        "![replicas and offered load](autoscale.png)\n"
    )
    extras, generated = old_extras(report)
    assert generated == "2026-12-01 21:21 UTC"
    assert extras["markdown"].startswith("## A replica killed")
    assert "autoscale.png" not in extras["markdown"]

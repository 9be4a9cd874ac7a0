"""The autoscale benchmark's report: its SLO check counts every wait inside the gateway, not only the
engine's; days (seeds) pool per mode; a hand-written reading survives a re-render."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import notes
from bench.autoscale import report
from bench.autoscale.client import Outcome, Sample
from bench.autoscale.report import honest_ttft_s, met_engine, pooled, summarise
from bench.autoscale.run import ModeRun, day_plan, old_extras


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


def day(mode: str, seed: int, met_first: int, held: int) -> ModeRun:
    """Four requests (two in the burst window 10-20 s), the first `met_first` within the SLO."""
    outcomes = []
    for i, sent in enumerate((1.0, 12.0, 15.0, 30.0)):
        ttft = 0.2 if i < met_first else 5.0
        outcomes.append(served(index=i, sent_s=sent, engine_ttft_s=ttft * 0.5, engine_tpot_s=0.01))
    samples = [Sample(float(t), {"chat": held}, {"chat": held}, held=held) for t in range(41)]
    pools = {"pools": [{"name": "chat", "startup_s": 5.0, "wake_s": 5.0, "measured": {"starts_s": [5.0]}}]}
    return ModeRun(mode, outcomes, samples, pools, seed=seed)


META: dict[str, Any] = {
    "generated": "2026-12-02 09:00 UTC", "minutes": 1.0, "host": "test", "load": [0.1, 0.2], "day_s": 40.0,
    "requests": {7: 4, 8: 4}, "seeds": [7, 8], "slo": {"ttft_s": 2.0, "tpot_s": 0.06}, "time_scale": 0.5,
    "interval_s": 2.0, "stabilization_s": 20.0, "burst_s": [10.0, 20.0],
}  # fmt: skip


def test_days_pool_per_mode_over_all_their_requests() -> None:
    rows = [summarise(r, META["slo"], 0.5, (10.0, 20.0)) for r in (day("tokens", 7, 4, 4), day("tokens", 8, 1, 2))]
    (tokens,) = pooled(rows)
    assert tokens["days"] == 2 and tokens["requests"] == 8
    assert tokens["attainment"] == 5 / 8
    assert tokens["day_attainment"] == [1.0, 0.25]
    assert tokens["burst"] == 2 / 4  # both of seed 7's burst requests, neither of seed 8's
    assert tokens["gpu_s"] == (4 * 40 + 2 * 40) / 2


def test_static_peak_runs_on_the_first_day_only() -> None:
    assert day_plan(["static-peak", "tokens"], [7, 8]) == [("static-peak", 7), ("tokens", 7), ("tokens", 8)]


def test_the_hand_written_reading_survives_a_re_render(tmp_path: Path) -> None:
    runs = [day("static-peak", 7, 4, 8), day("tokens", 7, 4, 4), day("tokens", 8, 3, 4)]
    curve = {"m": [(0.0, 1.0), (40.0, 1.0)]}
    report.write(tmp_path, META, runs, curve, {})
    assert "hand-written" not in (tmp_path / "autoscale.md").read_text()
    notes.notes_path(tmp_path / "autoscale.md").write_text("The burst decides it (a person's reading).\n")
    for _ in range(2):  # a run, then a --report-only rebuild: the reading is in both
        report.write(tmp_path, META, runs, curve, {})
        text = (tmp_path / "autoscale.md").read_text()
        assert text.count("The burst decides it (a person's reading).") == 1
        assert text.index("## Targets") < text.index(notes.HEADING)
    assert "Pooled over each mode's days" in text
    assert "| tokens | 2 | 87.5 % |" in text  # 7 of the 8 requests of its two days
    # no replica woke: the pool's wake time is its default, not a measurement
    assert "chat 5.0 / -" in text


def test_a_variant_writes_beside_the_default(tmp_path: Path) -> None:
    runs = [day("static-peak", 7, 4, 8), day("tokens", 7, 4, 4)]
    report.write(tmp_path, {**META, "seeds": [7]}, runs, {"m": [(0.0, 1.0)]}, {}, name="autoscale-fast")
    assert (tmp_path / "autoscale-fast.md").exists() and not (tmp_path / "autoscale.md").exists()
    assert "autoscale-fast.png" in (tmp_path / "autoscale-fast.md").read_text()

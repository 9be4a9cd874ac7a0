"""The `program` label (gateway/telemetry/programs.py): an agent run's calls, tokens and dollars under
its own id while it is among the `max_programs` named runs; a new run takes the slot of one idle for
`program_idle_s`, else counts as "other"; an evicted run's series leave the exposition; calls without
a program are not in these series; outcomes are counted per tenant, never per program."""

from __future__ import annotations

from gateway.app.settings import MetricLabelsConfig, MetricsConfig
from gateway.telemetry.families import OTHER
from gateway.telemetry.metrics import GatewayMetrics
from tests.gateway.telemetry.test_metrics import ok_record, parse, value


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def programs_in(metrics: GatewayMetrics) -> set[str]:
    _, samples = parse(metrics)
    return {dict(labels)["program"] for (n, labels) in samples if n == "tokenway_program_calls_total"}


def metrics_with(max_programs: int, clock: Clock) -> GatewayMetrics:
    labels = MetricLabelsConfig(max_programs=max_programs, program_idle_s=60.0)
    return GatewayMetrics(MetricsConfig(labels=labels), now_s=clock)


def test_a_run_s_calls_tokens_and_dollars_are_counted_under_its_id() -> None:
    metrics = metrics_with(4, Clock())
    metrics.observe(ok_record(program="run-1"))
    metrics.observe(ok_record(program="run-1", completion_tokens=100, cost_usd=0.5))
    metrics.observe(ok_record())  # no program: not in the program series
    _, samples = parse(metrics)
    assert value(samples, "tokenway_program_calls_total", tenant="acme", program="run-1") == 2
    assert value(samples, "tokenway_program_calls_total") == 2
    assert value(samples, "tokenway_program_tokens_total", program="run-1", token_type="output") == 400
    assert value(samples, "tokenway_program_tokens_total", program="run-1", token_type="input") == 2400
    assert abs(value(samples, "tokenway_program_cost_usd_total", program="run-1") - 0.50123) < 1e-9


def test_live_runs_past_the_cap_count_as_other_until_a_run_goes_idle() -> None:
    clock = Clock()
    metrics = metrics_with(2, clock)
    for run in ("a", "b", "c"):
        metrics.observe(ok_record(program=run))
    assert programs_in(metrics) == {"a", "b", OTHER}  # every slot held by a run that called within 60 s
    clock.now += 30
    metrics.observe(ok_record(program="a"))  # a stays live; b is now the idlest
    clock.now += 40  # b idle 70 s, a 40 s
    metrics.observe(ok_record(program="d"))
    assert programs_in(metrics) == {"a", "d", OTHER}  # b's series left with its slot
    assert metrics.programs.evicted == 1
    assert len(metrics.programs) == 2
    _, samples = parse(metrics)
    assert value(samples, "tokenway_program_calls_total", program="a") == 2
    assert value(samples, "tokenway_program_calls_total", program=OTHER) == 1


def test_the_series_stay_bounded_under_many_runs() -> None:
    clock = Clock()
    metrics = metrics_with(8, clock)
    for i in range(2000):
        clock.now += 1.0
        metrics.observe(ok_record(program=f"run-{i}", tenant="acme" if i % 2 else "globex"))
    names = programs_in(metrics)
    assert len(names) <= 8 + 1
    assert len(metrics.programs) == 8


def test_a_run_named_other_shares_the_overflow_series_and_zero_turns_the_label_off() -> None:
    clock = Clock()
    metrics = metrics_with(1, clock)
    metrics.observe(ok_record(program=OTHER))
    metrics.observe(ok_record(program="x"))
    clock.now += 120
    metrics.observe(ok_record(program="y"))  # takes x's slot; the "other" series is never evicted
    assert programs_in(metrics) == {OTHER, "y"}
    off = metrics_with(0, clock)
    off.observe(ok_record(program="x"))
    assert programs_in(off) == set()


def test_outcomes_are_counted_per_tenant_and_result() -> None:
    metrics = GatewayMetrics()
    metrics.observe_outcome("acme", True, 3.0)
    metrics.observe_outcome("acme", True, None)
    metrics.observe_outcome("acme", False, 7.0)  # a failure's value is not added
    _, samples = parse(metrics)
    assert value(samples, "tokenway_program_outcomes_total", tenant="acme", success="true") == 2
    assert value(samples, "tokenway_program_outcomes_total", tenant="acme", success="false") == 1
    assert value(samples, "tokenway_program_outcome_value_total", tenant="acme") == 3.0

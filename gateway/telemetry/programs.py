"""Per-program series: an agent run's calls, tokens and dollars in Prometheus, with a bounded label.

A program id is client input and runs are short-lived and many (docs/agents.md), so a `program`
label that took every id would grow without end. The label goes to at most `max_programs` runs per
process at a time: a run takes a free slot at its first call; when none is free it takes the slot of
the run that has been idle longest, once that run has been idle for `idle_s` (its series leave the
exposition, as a finished job's do); when every slot holds a run that called within `idle_s`, the
call is counted under `program="other"` of its tenant. So the busiest live runs are named and a
dashboard can alert on one run's spend rate, while the series count stays within
`max_programs` x 4 + tenants x 4. A run evicted and seen again starts fresh series (Prometheus
reads it as a counter reset). Every call is also in the tenant/model families whatever happens here,
and the ledger keeps every run's exact spend (`usage report --by program`).

Outcomes (`POST /v1/programs/{id}/outcome`) are counted per tenant and result, never per program:
`tokenway_program_outcomes_total{tenant, success}` and the value the successes reported.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.request.record import RequestRecord
from gateway.telemetry import genai
from gateway.telemetry.families import OTHER, CounterChild, CounterFamily, Family, LabelGuard


@dataclass(slots=True, frozen=True)
class _Series:
    calls: CounterChild
    input_tokens: CounterChild
    output_tokens: CounterChild
    cost_usd: CounterChild


class ProgramMetrics:
    """The program families and the table that bounds their `program` label (module doc)."""

    def __init__(self, tenant_guard: LabelGuard, *, max_programs: int, idle_s: float, now_s: Callable[[], float]):
        self._tenant = tenant_guard
        self._max = max_programs
        self._idle_s = idle_s
        self._now_s = now_s
        # (tenant label, program) -> (series, last call); oldest call first
        self._named: OrderedDict[tuple[str, str], tuple[_Series, float]] = OrderedDict()
        self._other: dict[str, _Series] = {}  # tenant label -> its "other" series (bounded by the guard)
        self.evicted = 0  # named runs whose series left to make room (a hint that max_programs is small)
        self.calls = CounterFamily(
            "tokenway_program_calls_total",
            "finished calls of an agent program (run), by tenant and program; at most labels.max_programs runs are "
            "named at a time, the others count as program=other",
            ("tenant", "program"),
            otel_name="tokenway.program.calls",
            unit="{request}",
        )
        self.tokens = CounterFamily(
            "tokenway_program_tokens_total",
            "tokens of an agent program's calls by token_type (input, output); program bounded as for calls",
            ("tenant", "program", "token_type"),
            otel_name="tokenway.program.tokens",
            unit="{token}",
        )
        self.cost = CounterFamily(
            "tokenway_program_cost_usd_total",
            "dollars of an agent program's calls; program bounded as for calls",
            ("tenant", "program"),
            otel_name="tokenway.program.cost",
            unit="USD",
        )
        self.outcomes = CounterFamily(
            "tokenway_program_outcomes_total",
            "program outcomes posted to /v1/programs/{id}/outcome, by tenant and success (true, false)",
            ("tenant", "success"),
            otel_name="tokenway.program.outcomes",
            unit="{program}",
        )
        self.outcome_value = CounterFamily(
            "tokenway_program_outcome_value_total",
            "the value successful programs reported with their outcome, by tenant",
            ("tenant",),
            otel_name="tokenway.program.outcome_value",
        )
        self.families: tuple[Family, ...] = (self.calls, self.tokens, self.cost, self.outcomes, self.outcome_value)

    def __len__(self) -> int:
        """Runs named now (at most `max_programs`)."""
        return len(self._named)

    def observe(self, record: RequestRecord, program: str) -> None:
        """One finished call of `program` (the record's bounded id)."""
        tenant = self._tenant(record.tenant)
        key = (tenant, program)
        now = self._now_s()
        found = self._named.get(key)
        if found is not None:
            series = found[0]
            self._named[key] = (series, now)
            self._named.move_to_end(key)
        elif program == OTHER:  # a run named "other" shares its tenant's overflow series
            series = self._other_series(tenant)
        else:
            series = self._admit(key, now)
        series.calls.value += 1.0
        series.input_tokens.value += record.prompt_tokens
        series.output_tokens.value += record.completion_tokens
        series.cost_usd.value += record.cost_usd

    def observe_outcome(self, tenant: str, success: bool, value: float | None) -> None:
        label = self._tenant(tenant)
        self.outcomes.child(label, "true" if success else "false").value += 1.0
        if success and value is not None:
            self.outcome_value.child(label).value += value

    def _admit(self, key: tuple[str, str], now: float) -> _Series:
        if len(self._named) >= self._max:
            oldest = next(iter(self._named), None)
            if oldest is None or now - self._named[oldest][1] < self._idle_s:
                return self._other_series(key[0])
            self._named.popitem(last=False)
            self._remove(oldest)
            self.evicted += 1
        series = self._series(*key)
        self._named[key] = (series, now)
        return series

    def _other_series(self, tenant: str) -> _Series:
        found = self._other.get(tenant)
        if found is None:
            found = self._other[tenant] = self._series(tenant, OTHER)
        return found

    def _series(self, tenant: str, program: str) -> _Series:
        return _Series(
            calls=self.calls.child(tenant, program),
            input_tokens=self.tokens.child(tenant, program, genai.TOKEN_INPUT),
            output_tokens=self.tokens.child(tenant, program, genai.TOKEN_OUTPUT),
            cost_usd=self.cost.child(tenant, program),
        )

    def _remove(self, key: tuple[str, str]) -> None:
        tenant, program = key
        self.calls.remove(tenant, program)
        self.tokens.remove(tenant, program, genai.TOKEN_INPUT)
        self.tokens.remove(tenant, program, genai.TOKEN_OUTPUT)
        self.cost.remove(tenant, program)

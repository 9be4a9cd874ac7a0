"""`tokenway usage report --by outcome`: cost per successful program and per unit of value.

An agent program's requests carry its id (`program`, docs/agents.md); its end is one ledger record
of kind `outcome` (`POST /v1/programs/{id}/outcome`: success, optional value). This report joins
them per tenant and program, then sums per (tenant, model): how many programs reported an outcome,
how many succeeded, their value, what their requests on that model cost, and so the cost per
success and per unit of value beside the cost per million tokens. A program that used two models
counts on both rows, with each model's share of its cost. Spend of programs that reported no outcome
(still running, or never told) is shown apart, never divided.

Memory: one small accumulator per (tenant, program) in the window, since a program's outcome may
come after all of its requests or, in another replica's file, before them.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.ledger.report import Format, ReportError

COLUMNS = (
    "programs", "succeeded", "value", "cost_usd", "cost_per_success_usd", "cost_per_value_usd", "cpm_usd",
    "no_outcome_cost_usd",
)  # fmt: skip
GROUP = ("tenant", "model")
DECIMALS = {
    "value": 4,
    "cost_usd": 6,
    "cost_per_success_usd": 6,
    "cost_per_value_usd": 6,
    "cpm_usd": 4,
    "no_outcome_cost_usd": 6,
}


def is_outcome(entry: dict[str, Any]) -> bool:
    """An outcome record (not a request): request reports skip these."""
    return entry.get("kind") == "outcome"


@dataclass(slots=True)
class _Program:
    by_model: dict[str, list[float]] = field(default_factory=dict)  # model -> [cost, tokens]
    outcome: tuple[bool, float] | None = None  # (success, value)


@dataclass(slots=True)
class _Row:
    programs: int = 0
    succeeded: int = 0
    value: float = 0.0
    cost_usd: float = 0.0
    tokens: int = 0
    no_outcome_cost_usd: float = 0.0

    def metrics(self) -> dict[str, float | int | None]:
        return {
            "programs": self.programs,
            "succeeded": self.succeeded,
            "value": self.value,
            "cost_usd": self.cost_usd,
            "cost_per_success_usd": self.cost_usd / self.succeeded if self.succeeded else None,
            "cost_per_value_usd": self.cost_usd / self.value if self.value > 0 else None,
            "cpm_usd": self.cost_usd / self.tokens * 1e6 if self.tokens else None,
            "no_outcome_cost_usd": self.no_outcome_cost_usd,
        }


class OutcomeReport:
    """Entries in (request and outcome records, any order); rows per (tenant, model) out."""

    def __init__(self) -> None:
        self.programs: dict[tuple[str, str], _Program] = {}

    def add(self, entry: dict[str, Any]) -> None:
        program = entry.get("program")
        if not isinstance(program, str) or not program:
            return
        key = (str(entry.get("tenant") or ""), program)
        state = self.programs.get(key)
        if state is None:
            state = self.programs[key] = _Program()
        if is_outcome(entry):
            if state.outcome is None:  # the gateway writes one; a copied file must not count twice
                value = entry.get("value")
                success = entry.get("success") is True
                state.outcome = (success, float(value) if success and isinstance(value, int | float) else 0.0)
            return
        model = str(entry.get("model") or entry.get("requested_model") or "")
        totals = state.by_model.setdefault(model, [0.0, 0.0])
        totals[0] += float(entry.get("cost_usd") or 0.0)
        totals[1] += float((entry.get("input_tokens") or 0) + (entry.get("output_tokens") or 0))

    def rows(self) -> list[dict[str, Any]]:
        groups: dict[tuple[str, str], _Row] = {}
        for (tenant, _program), state in self.programs.items():
            for model, (cost, tokens) in state.by_model.items():
                row = groups.setdefault((tenant, model), _Row())
                if state.outcome is None:
                    row.no_outcome_cost_usd += cost
                    continue
                row.programs += 1
                row.succeeded += int(state.outcome[0])
                row.value += state.outcome[1]
                row.cost_usd += cost
                row.tokens += int(tokens)
        ordered = sorted(groups.items(), key=lambda kv: (-kv[1].cost_usd, kv[0]))
        return [{"tenant": tenant, "model": model, **row.metrics()} for (tenant, model), row in ordered]


def build_outcome_report(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    report = OutcomeReport()
    for entry in entries:
        report.add(entry)
    return report.rows()


def render_outcomes(rows: list[dict[str, Any]], fmt: Format) -> str:
    if fmt == "json":
        return orjson.dumps({"by": ["outcome", *GROUP], "groups": rows}, option=orjson.OPT_INDENT_2).decode() + "\n"
    columns = [*GROUP, *COLUMNS]
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(c, row[c], "") for c in columns])
        return buf.getvalue()
    if fmt != "table":
        raise ReportError(f"unknown format {fmt!r}")
    body = [[_cell(c, row[c], "-") for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(columns)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < len(GROUP) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(columns), "  ".join("-" * w for w in widths), *(line(r) for r in body)]) + "\n"


def _cell(column: str, value: Any, none: str) -> str:
    if value is None:
        return none
    decimals = DECIMALS.get(column)
    if decimals is not None:
        return f"{value:.{decimals}f}"
    return str(value) if value != "" else none

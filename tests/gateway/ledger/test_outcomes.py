"""Outcome records in the ledger: request reports skip them; `--by outcome` joins them to their
program's requests whatever the order the files hold them in."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.http.outcome import outcome_line, parse_outcome
from gateway.ledger.outcomes import build_outcome_report, render_outcomes
from gateway.ledger.report import build_report
from gateway.ledger.writer import decode


def request(program: str | None, cost: float, model: str = "m", tenant: str = "t") -> dict[str, Any]:
    return {"v": 1, "ts": 1.0, "tenant": tenant, "model": model, "program": program, "status": "ok",
            "cost_usd": cost, "input_tokens": 10, "output_tokens": 10}  # fmt: skip


def outcome(program: str, success: bool, value: float | None = None, tenant: str = "t") -> dict[str, Any]:
    line = outcome_line(
        request="r", tenant=tenant, key_id="k", program=program, success=success, value=value, now_s=2.0
    )
    return decode(line)


def test_request_reports_do_not_count_outcomes() -> None:
    report = build_report([request("p", 1.0), outcome("p", True, 3)], ["tenant"])
    assert report.total.requests == 1 and report.total.cost_usd == 1.0


def test_cost_per_success_and_value_whatever_the_order() -> None:
    entries = [
        outcome("a", True, 2),  # before its requests (another replica's file read first)
        request("a", 1.0),
        request("a", 1.0, model="n"),
        request("b", 2.0),
        outcome("b", False, 5),  # a failure's value is not counted
        request("c", 0.5),  # no outcome yet
        request(None, 9.0),  # no program
        outcome("a", False),  # a copied file: the first outcome stands
        request("a", 1.0, tenant="u"),  # another tenant's "a": no outcome
    ]
    rows = {(r["tenant"], r["model"]): r for r in build_outcome_report(entries)}
    m = rows[("t", "m")]
    assert (m["programs"], m["succeeded"], m["value"], m["cost_usd"]) == (2, 1, 2.0, 3.0)
    assert m["cost_per_success_usd"] == 3.0 and m["cost_per_value_usd"] == 1.5 and m["no_outcome_cost_usd"] == 0.5
    assert m["cpm_usd"] == pytest.approx(3.0 / 40 * 1e6)
    assert rows[("t", "n")]["programs"] == 1 and rows[("u", "m")]["no_outcome_cost_usd"] == 1.0
    assert rows[("u", "m")]["cost_per_success_usd"] is None
    for fmt in ("table", "csv", "json"):
        assert "cost_per_success_usd" in render_outcomes(list(rows.values()), fmt)


@pytest.mark.parametrize(
    ("body", "param"),
    [({}, "success"), ({"success": 1}, "success"), ({"success": True, "value": True}, "value"),
     ({"success": True, "value": 1e300}, "value"), ({"success": True, "other": 1}, "other")],
)  # fmt: skip
def test_bodies_are_checked_field_by_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_outcome(body)
    assert caught.value.param == param
    assert parse_outcome({"success": False, "value": 2}) == (False, 2.0)

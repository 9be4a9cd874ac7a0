"""The spend reconciliation's status (`/admin/status` → `spend_reconciliation`) has one shape from the
start: before the first check a reader finds `periods` and `over_tolerance` there, empty, rather
than a KeyError (an end-to-end test that polled it met one under load)."""

from __future__ import annotations

from typing import Any

from gateway.ledger.reconcile import SpendReconciler
from gateway.ledger.writer import SpendTally


def test_the_status_before_the_first_check_has_every_field_a_reader_indexes() -> None:
    unused: Any = None  # nothing is asked of the admission view, policy or principals before a check
    status = SpendReconciler(SpendTally(10), unused, lambda: unused, lambda key, policy: None).status()
    assert status["checked_at_unix_s"] is None
    assert status["periods"] == {} and status["over_tolerance"] == []
    assert [row for row in status["over_tolerance"] if row["key"] == "k1"] == []  # what a poller does

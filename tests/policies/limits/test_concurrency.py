"""Expiring concurrency leases."""

from __future__ import annotations

from policies.limits.memory_store import LeaseTable


def test_leases_count_until_released_or_expired() -> None:
    table = LeaseTable()
    table.acquire("k", "a", expires_at_s=10.0)
    table.acquire("k", "b", expires_at_s=20.0)
    assert table.active("k", 5.0) == 2
    table.release("k", "a")
    assert table.active("k", 5.0) == 1
    assert table.active("k", 20.0) == 0  # expired at its deadline
    table.release("k", "missing")
    assert table.items(0.0) == []


def test_sweep_forgets_keys_without_live_leases() -> None:
    table = LeaseTable()
    table.acquire("k1", "a", expires_at_s=1.0)
    table.acquire("k2", "b", expires_at_s=100.0)
    table.sweep(50.0)
    assert table.items(50.0) == [("k2", 1)]

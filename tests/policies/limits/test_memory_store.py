"""The memory store beyond what test_admission covers: fail-open shares, seeding, bounded memory."""

from __future__ import annotations

import pytest

from policies.limits.memory_store import MemoryStore
from policies.limits.plan import BucketSpec, BudgetSpec, Charge, Settlement
from tests.policies.limits.support import policy, principal


def test_a_share_holds_limit_over_replicas_seeded_from_the_known_global_state() -> None:
    p = policy(limits=[{"scope": "key", "tpm": 6000}], budgets=[{"scope": "key", "usd_per_day": 1.0}])
    plan = p.admission_plan(principal(p), "big")

    def seed(spec: BucketSpec | BudgetSpec, now_s: float) -> float | None:
        return 3000.0 if isinstance(spec, BucketSpec) else 0.5

    store = MemoryStore(seed=seed)
    store.scale = 0.5  # two replicas
    out = store.reserve_now(plan, Charge("a", [500.0], 0.1), now_s=0.0)
    assert out.admitted and out.bucket_used == [1500.0] and out.budget_spent == [0.25]
    assert out.capacity_scale == 0.5
    out = store.reserve_now(plan, Charge("b", [1100.0], 0.1), now_s=0.0)
    assert not out.admitted  # 2000 + 1100 > 3000 = this replica's share


def test_an_empty_share_still_admits_what_the_whole_limit_could() -> None:
    p = policy(limits=[{"scope": "key", "tpm": 6000}])
    plan = p.admission_plan(principal(p), "big")
    store = MemoryStore()
    store.scale = 0.25
    assert store.reserve_now(plan, Charge("a", [5000.0], 0.0), now_s=0.0).admitted
    assert not store.reserve_now(plan, Charge("b", [10.0], 0.0), now_s=0.0).admitted


def test_sweep_forgets_full_buckets_and_past_budgets() -> None:
    p = policy(limits=[{"scope": "key", "rpm": 60}], budgets=[{"scope": "key", "usd_per_day": 1.0}])
    plan = p.admission_plan(principal(p), "big")
    store = MemoryStore()
    store.reserve_now(plan, Charge("a", [1.0], 0.1), now_s=0.0)
    assert len(store.snapshot(now_s=0.0)) == 2
    store.sweep(now_s=2 * 86_400.0)
    assert store.snapshot(now_s=2 * 86_400.0) == []


def test_settling_after_clear_is_harmless() -> None:
    p = policy(limits=[{"scope": "key", "tpm": 6000}])
    plan = p.admission_plan(principal(p), "big")
    store = MemoryStore()
    store.reserve_now(plan, Charge("a", [500.0], 0.0), now_s=0.0)
    store.clear()
    store.apply_now(plan, Settlement("a", "memory", [-400.0], 0.0, [], 0.0), now_s=0.0)
    assert store.snapshot(now_s=0.0) == []


def test_snapshot_rows_for_status_and_gauges() -> None:
    p = policy(
        limits=[{"scope": "key", "tpm": 6000, "max_concurrent": 3}], budgets=[{"scope": "key", "usd_per_day": 2}]
    )
    plan = p.admission_plan(principal(p), "big")
    store = MemoryStore()
    store.reserve_now(plan, Charge("a", [600.0], 0.5), now_s=0.0)
    rows = {row["kind"]: row for row in store.snapshot(now_s=0.0)}
    assert rows["bucket"]["remaining"] == 5400.0 and rows["bucket"]["reset_s"] == pytest.approx(6.0)
    assert rows["concurrency"]["active"] == 1 and rows["concurrency"]["capacity"] == 3
    assert rows["budget"]["remaining_usd"] == 1.5

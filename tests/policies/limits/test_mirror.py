"""The local mirror may reject early from fresh state, and never admits."""

from __future__ import annotations

from policies.limits.failover import Mirror
from policies.limits.plan import Charge, Outcome, Settlement
from tests.policies.limits.support import policy, principal


def test_precheck_rejects_only_from_fresh_entries_that_are_short() -> None:
    p = policy(limits=[{"scope": "key", "tpm": 6000}])
    plan = p.admission_plan(principal(p), "big")
    mirror = Mirror(max_age_s=1.0)
    assert mirror.precheck(plan, Charge("x", [100.0], 0.0), now_s=10.0) is None  # nothing known
    mirror.record(plan, Charge("a", [5000.0], 0.0), Outcome(True, 10.0, [900.0], [], [], [], "redis"))
    early = mirror.precheck(plan, Charge("b", [200.0], 0.0), now_s=10.0)
    assert early is not None and not early.admitted and early.bucket_used == [5900.0]
    assert mirror.precheck(plan, Charge("c", [100.0], 0.0), now_s=10.0) is None  # fits: ask Redis
    assert mirror.precheck(plan, Charge("d", [200.0], 0.0), now_s=11.5) is None  # stale: ask Redis


def test_own_settlements_correct_the_mirror() -> None:
    p = policy(limits=[{"scope": "key", "tpm": 6000}])
    plan = p.admission_plan(principal(p), "big")
    mirror = Mirror()
    mirror.record(plan, Charge("a", [5000.0], 0.0), Outcome(True, 10.0, [900.0], [], [], [], "redis"))
    mirror.settled(plan, Settlement("a", "redis", [-4000.0], 0.0, [], 0.0))
    assert mirror.used_at(plan.buckets[0].key, 10.0) == 1900.0
    assert mirror.precheck(plan, Charge("b", [1000.0], 0.0), now_s=10.0) is None

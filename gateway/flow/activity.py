"""Who is active in each pool: requests waiting and in flight per tenant, and when each was last seen.

The slot reserve (`policies.flow.reserve`) reads it: a tenant stays active `active_s` after its last
request left, so a light tenant between two requests keeps its claim on the reserve. Bounded: idle
tenants are dropped once their `active_s` has passed, and at most `max_tenants` are kept per pool
(the longest idle go first).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from policies.flow.reserve import Active

_MAX_TENANTS: Final = 4096


@dataclass(slots=True)
class _Seen:
    band: int
    weight: float
    waiting: int = 0
    inflight: int = 0
    last_s: float = 0.0


@dataclass(slots=True)
class Activity:
    active_s: float = 60.0
    max_tenants: int = _MAX_TENANTS
    now: Callable[[], float] = field(default=time.monotonic)
    _pools: dict[str, dict[str, _Seen]] = field(default_factory=dict)

    def waiting(self, pool: str, tenant: str, band: int, weight: float, delta: int) -> None:
        seen = self._seen(pool, tenant, band, weight)
        seen.waiting = max(seen.waiting + delta, 0)

    def inflight(self, pool: str, tenant: str, band: int, weight: float, delta: int) -> None:
        seen = self._seen(pool, tenant, band, weight)
        seen.inflight = max(seen.inflight + delta, 0)

    def active(self, pool: str) -> dict[str, Active]:
        """Tenant -> what the reserve reads, for the tenants active in `pool` now."""
        tenants = self._pools.get(pool)
        if not tenants:
            return {}
        cutoff = self.now() - self.active_s
        out: dict[str, Active] = {}
        for tenant, seen in list(tenants.items()):
            if seen.waiting or seen.inflight or seen.last_s >= cutoff:
                out[tenant] = Active(seen.band, seen.weight, seen.inflight, seen.waiting)
            else:
                del tenants[tenant]
        return out

    def _seen(self, pool: str, tenant: str, band: int, weight: float) -> _Seen:
        tenants = self._pools.setdefault(pool, {})
        seen = tenants.get(tenant)
        if seen is None:
            if len(tenants) >= self.max_tenants:
                self._evict(tenants)
            seen = tenants[tenant] = _Seen(band, weight)
        seen.band, seen.weight, seen.last_s = band, weight, self.now()
        return seen

    @staticmethod
    def _evict(tenants: dict[str, _Seen]) -> None:
        idle = [(s.last_s, t) for t, s in tenants.items() if not s.waiting and not s.inflight]
        if idle:
            del tenants[min(idle)[1]]
        else:  # every one busy: the least recently seen goes (its counts come back with its next request)
            del tenants[min((s.last_s, t) for t, s in tenants.items())[1]]

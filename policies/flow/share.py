"""Service shares: how much each tenant received of a pool lately, against what its weight entitles.

`ServiceWindow` sums each tenant's cost (the same tokens the virtual counters charge, corrected when a
request ends) over a sliding window in one-second buckets: O(window) memory per tenant, and tenants
are the configured ones.

`fair_share_ratios` is each tenant's share of the service divided by its weight's share among the
tenants served in the window: 1.0 is exactly its weighted share, below 1 it received less (because it
asked for less, or because others were favoured), above 1 more. A tenant that asks for less than its
share reads below 1 without anything being unfair; `bench/fairness` compares against the max-min fair
allocation of what each tenant asked for.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping


class ServiceWindow:
    __slots__ = ("_buckets", "window_s")

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._buckets: dict[str, deque[list[float]]] = {}  # tenant -> [second, cost] oldest first

    def add(self, tenant: str, cost_tokens: float, now_s: float) -> None:
        second = float(math.floor(now_s))
        buckets = self._buckets.get(tenant)
        if buckets is None:
            buckets = self._buckets[tenant] = deque()
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += cost_tokens
        else:
            buckets.append([second, cost_tokens])
        self._trim(buckets, now_s)

    def _trim(self, buckets: deque[list[float]], now_s: float) -> None:
        oldest = now_s - self.window_s
        while buckets and buckets[0][0] < oldest:
            buckets.popleft()

    def totals(self, now_s: float) -> dict[str, float]:
        """Tenant -> service in the window (tenants with none left out)."""
        out: dict[str, float] = {}
        for tenant, buckets in list(self._buckets.items()):
            self._trim(buckets, now_s)
            if not buckets:
                del self._buckets[tenant]
                continue
            out[tenant] = sum(cost for _, cost in buckets)
        return out


def fair_share_ratios(service: Mapping[str, float], weight: Mapping[str, float]) -> dict[str, float]:
    """Tenant -> (its share of `service`) / (its weight's share among the tenants in `service`)."""
    total = sum(max(v, 0.0) for v in service.values())
    weights = sum(weight.get(t, 1.0) for t in service)
    if total <= 0 or weights <= 0:
        return {}
    return {t: (max(v, 0.0) / total) / (weight.get(t, 1.0) / weights) for t, v in service.items()}

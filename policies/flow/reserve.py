"""Slot reserve: a few free batch slots kept for tenants under their share of what is in flight.

Strict work-conserving flow control lets a flooding tenant fill every batch slot while nobody else
waits; a light tenant's next request then waits for a running sequence to finish (the engines do not
preempt for it), so its TTFT is the time until the next completion, not its prefill. With
`reserve_slots: k` (per pool, default 0: strictly work-conserving) the last `k` free slots of a pool
go only to a request whose tenant, after it, would hold no more than its weighted share of the band's
requests in flight, and to nobody in a band below one that has an active tenant. A tenant counts as
active while it has requests waiting or in flight, and for `reserve_active_s` after its last one.

The reserve is kept for active tenants that are *not* waiting (the next request of a light tenant);
when every other active tenant of the band and the bands above it has requests waiting, there is
nobody to keep it for, and it goes in flow order like any slot (the virtual counters share it in
tokens; a share of requests in flight would favour the tenant of shorter requests). So its cost is those `k` slots idle
while a flood runs beside a light tenant; a tenant alone in its band (and no higher band active), or
tenants all backlogged, use every slot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from backends.types import Endpoint


@dataclass(frozen=True, slots=True)
class Active:
    """A tenant recently active in a pool: its band, its weight, its requests in flight and waiting there."""

    band: int
    weight: float
    inflight: int
    waiting: int = 0


def free_slots(endpoints: Iterable[Endpoint], max_num_seqs: int, now_s: float, max_stats_age_s: float) -> int:
    """Batch slots no request holds across the ready endpoints: the batch size less the larger of the
    gateway's in-flight count there (its own and what other replicas report) and the engine's scraped
    running + waiting (when fresh: it also counts requests that did not come through this gateway)."""
    free = 0
    for e in endpoints:
        if not e.ready:
            continue
        held = e.inflight.requests
        if e.stats_age_s(now_s) <= max_stats_age_s:
            held = max(held, e.stats.running + e.stats.waiting)
        free += max(max_num_seqs - held, 0)
    return free


def within_share(tenant: str, band: int, weight: float, active: Mapping[str, Active]) -> bool:
    """May one more request of `tenant` (in `band`) take a reserved slot?

    Yes when, after it, the tenant would hold no more than its weighted share of its band's requests
    in flight and no tenant of a higher band is active (the tenant itself counts as active). Also yes
    when there is nobody to keep the slot for: every other active tenant of its band and the bands
    above has requests waiting (flow order decides between backlogged tenants, in tokens)."""
    own = active.get(tenant)
    tenants = dict(active)
    if own is None:
        tenants[tenant] = Active(band, weight, 0, 1)
    weights: dict[int, float] = {}
    inflight: dict[int, int] = {}
    for seen in tenants.values():
        weights[seen.band] = weights.get(seen.band, 0.0) + seen.weight
        inflight[seen.band] = inflight.get(seen.band, 0) + seen.inflight

    def under_share(seen: Active) -> bool:
        return (seen.inflight + 1) * weights[seen.band] <= seen.weight * (inflight[seen.band] + 1)

    me = tenants[tenant]
    if under_share(me) and not any(seen.band < band for seen in tenants.values()):
        return True
    for other, seen in tenants.items():
        if other == tenant or seen.band > band:
            continue
        if not seen.waiting:
            return False  # kept for its next request
    return True


def may_take(
    tenant: str, band: int, weight: float, active: Mapping[str, Active], free: int, reserve_slots: int
) -> bool:
    """Whether a request may take one of `free` slots when `reserve_slots` are kept."""
    return reserve_slots <= 0 or free - 1 >= reserve_slots or within_share(tenant, band, weight, active)

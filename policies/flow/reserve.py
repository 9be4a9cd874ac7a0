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

How many slots: a fixed `k` is right only for one load. A light tenant's need is its requests in
flight at once, which varies with its rate, its requests' length and its bursts; once it holds as
many as it has ever needed the reserve serves nobody, and while a burst runs it may need more than
`k`. With `reserve_max_slots` above `reserve_slots` the reserve is sized from recent demand instead
(`reserve_for`): the slots the tenants it is kept for held at most at once (in flight and waiting)
over the recent window, less what they hold now, plus `reserve_margin` for a burst beyond that
peak, never below `reserve_slots` and never above `reserve_max_slots`. So a light tenant's next
request finds a free slot unless its demand exceeds anything it showed recently (the peak then
grows with it), and the slots idle are its unused recent headroom, not a guess.

A free slot is not the whole of a light tenant's TTFT: on the engine its prompt is prefilled in a
step shared with whatever else starts then, and a step that prefills two prompts takes about twice
as long as one (`backends/perf/roofline.py`: on the benchmark's engine 103 against 54 ms with six
decodes). So with `reserve_avoid_prefills` a request the reserve is kept *for* (`within_share`) goes to an
open endpoint with no prefill pending (`clear_of_prefill`: every request the gateway sent there has
its first token) when there is one, rather than into a step that prefills the flood's prompt. That
needs an endpoint left clear, and the flood kept out of the light prompt's step: with
`reserve_clear_lane` a request over its share starts only where no prefill is pending and only while
another endpoint with a free slot has none pending either (`clear_lane`), so the flood's prompts
start one at a time and some endpoint is always clear for the next light request; a tenant the
slot count calls within its share is held too when it had at least its weighted share of the band's
recent tokens beside a tenant that had less (`heavier_than_another`). (A non-streamed
request shows its first token only with its answer; the dispatcher counts its prompt as prefilled at
its predicted TTFT when the router predicted one, see `gateway/request/dispatch.py`.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from backends.types import Endpoint
from policies.flow.bands import BANDS, band_name


@dataclass(frozen=True, slots=True)
class Active:
    """A tenant recently active in a pool: its band, its weight, its requests in flight and waiting
    there, `peak`, the most it had in flight and waiting at once over the recent window, and
    `claimed`, slots preemption cut for it that none of its requests took yet."""

    band: int
    weight: float
    inflight: int
    waiting: int = 0
    peak: int = 0
    claimed: int = 0


@dataclass(frozen=True, slots=True)
class ReserveSize:
    """A pool's reserve: `min_slots` kept always; with `max_slots` above it, sized from the recent
    demand of the tenants it is kept for plus `margin`, within [min_slots, max_slots]."""

    min_slots: int = 0
    max_slots: int | None = None  # None or <= min_slots: fixed at min_slots
    margin: int = 1

    @property
    def enabled(self) -> bool:
        return self.min_slots > 0 or (self.max_slots or 0) > 0

    @property
    def sized(self) -> bool:
        """Sized from demand (a cap above the floor), not fixed at `min_slots`."""
        return self.max_slots is not None and self.max_slots > self.min_slots


def free_slots(endpoints: Iterable[Endpoint], max_num_seqs: int, now_s: float, max_stats_age_s: float) -> int:
    """Batch slots no request holds across the ready endpoints (`free_on` each)."""
    return sum(free_on(e, max_num_seqs, now_s, max_stats_age_s) for e in endpoints if e.ready)


def free_on(endpoint: Endpoint, max_num_seqs: int, now_s: float, max_stats_age_s: float) -> int:
    """Batch slots no request holds on one endpoint: the batch size less the larger of the gateway's
    in-flight count there (its own and what other replicas report) and the engine's scraped running +
    waiting (when fresh: it also counts requests that did not come through this gateway), less what
    ended since that scrape."""
    held = endpoint.inflight.requests
    if endpoint.stats_age_s(now_s) <= max_stats_age_s:
        held = max(held, endpoint.engine_held())
    return max(max_num_seqs - held, 0)


def within_share(tenant: str, band: int, weight: float, active: Mapping[str, Active]) -> bool:
    """May one more request of `tenant` (in `band`) take a reserved slot?

    Yes when, after it, the tenant would hold no more than its weighted share of its band's requests
    in flight and no tenant of a higher band is active (the tenant itself counts as active). Also yes
    when there is nobody to keep the slot for: every other active tenant of its band and the bands
    above is backlogged (flow order decides between backlogged tenants, in tokens).

    A tenant with requests waiting is backlogged only when they would take it past its weighted share
    of the band's requests in flight. A light tenant's request that just arrived waits for the room's
    next round while others wait (the room is not bypassed then), and its burst of a few waits a
    little longer: neither is a backlog, and counting it as one gave the flood the reserved slot an
    instant before that request took the next, so the two prompts shared one prefill step."""
    own = active.get(tenant)
    tenants = dict(active)
    if own is None:
        tenants[tenant] = Active(band, weight, 0, 1)
    weights: dict[int, float] = {}
    inflight: dict[int, int] = {}
    for seen in tenants.values():
        weights[seen.band] = weights.get(seen.band, 0.0) + seen.weight
        inflight[seen.band] = inflight.get(seen.band, 0) + seen.inflight

    def under_share(seen: Active, more: int) -> bool:
        return (seen.inflight + more) * weights[seen.band] <= seen.weight * (inflight[seen.band] + more)

    me = tenants[tenant]
    if under_share(me, 1) and not any(seen.band < band for seen in tenants.values()):
        return True
    for other, seen in tenants.items():
        if other == tenant or seen.band > band:
            continue
        if not seen.waiting or under_share(seen, seen.waiting):
            return False  # kept for its next request, or for those waiting within its share
    return True


def reserve_for(tenant: str, band: int, active: Mapping[str, Active], size: ReserveSize) -> int:
    """Free slots kept against a request of `tenant` in `band`: the headroom the tenants it is kept
    for (active, not waiting, in its band or above, itself excluded) used recently and do not use now,
    plus the margin, within the size's bounds. Fixed at `min_slots` when `max_slots` is not above it."""
    if size.max_slots is None or not size.sized:
        return size.min_slots
    headroom = sum(headroom_of(seen) for other, seen in active.items() if other != tenant and seen.band <= band)
    return min(max(headroom + size.margin, size.min_slots), size.max_slots)


def headroom_of(seen: Active) -> int:
    """The slots a tenant used recently and does not use now (none while it has requests waiting:
    flow order, not the reserve, serves a backlogged tenant)."""
    return 0 if seen.waiting else max(seen.peak - seen.inflight, 0)


def clear_of_prefill(endpoints: Iterable[Endpoint]) -> list[Endpoint]:
    """The endpoints with no prefill pending: every request the gateway (any replica) sent there has
    its first token."""
    return [e for e in endpoints if e.inflight.prefill_tokens <= 0]


def clear_lane(
    opened: Iterable[Endpoint], endpoints: Iterable[Endpoint], max_num_seqs: int, now_s: float, max_stats_age_s: float
) -> list[Endpoint]:
    """Of the `opened` endpoints, those a request over its share may start on while the reserve is
    kept for someone else (`reserve_clear_lane`): one with no prefill pending, and only while another
    ready endpoint with a free slot has none pending either, so that the next request of a tenant
    under its share finds an endpoint whose next step prefills nobody else's prompt. In a pool of one
    ready endpoint only the first condition holds (the flood's prompt then never joins a step that
    prefills a light tenant's, but a light request may still arrive during the flood's prefill)."""
    ready = [e for e in endpoints if e.ready]
    lanes = [
        e.id for e in ready if e.inflight.prefill_tokens <= 0 and free_on(e, max_num_seqs, now_s, max_stats_age_s) > 0
    ]
    clear = [e for e in opened if e.inflight.prefill_tokens <= 0]
    if len(ready) < 2:
        return clear
    return [e for e in clear if any(lane != e.id for lane in lanes)]


def heavier_than_another(tenant: str, ratios: Mapping[str, float]) -> bool:
    """Whether `tenant` has had at least its weighted share of its band's recent service (in tokens:
    `ratios` are `tokenway_fair_share_ratio`, the band's tenants only) while another tenant of the
    band has had less: the tenant the clear lane holds back even when the slot count calls it within
    its share (a light tenant's burst can hold more than its share of the slots while asking far less
    than its share of the tokens, and the reserve then takes it for backlogged)."""
    return ratios.get(tenant, 0.0) >= 1.0 and any(r < 1.0 for other, r in ratios.items() if other != tenant)


def may_take(
    tenant: str, band: int, weight: float, active: Mapping[str, Active], free: int, reserve_slots: int
) -> bool:
    """Whether a request may take one of `free` slots when `reserve_slots` are kept."""
    return reserve_slots <= 0 or free - 1 >= reserve_slots or within_share(tenant, band, weight, active)


def describe(active: Mapping[str, Active], size: ReserveSize, free: int) -> dict[str, Any]:
    """What a pool's reserve keeps now and what it is sized from (`/admin/status`): `kept` is the
    reserve a request of a tenant none of the active ones, in the lowest band, would find (every
    active tenant's headroom counts); each tenant's row gives the inputs (in flight, waiting, recent
    peak, the headroom it adds) and `kept_against`, what that tenant's own next request finds kept.
    An operator reads here why a flood waits beside free slots, or why a light tenant did."""
    lowest = len(BANDS) - 1
    tenants: dict[str, Any] = {}
    for tenant, seen in sorted(active.items()):
        tenants[tenant] = {
            "band": band_name(seen.band),
            "weight": seen.weight,
            "inflight": seen.inflight,
            "waiting": seen.waiting,
            "peak": seen.peak,
            "headroom": headroom_of(seen),
            "kept_against": reserve_for(tenant, seen.band, active, size),
            "within_share": within_share(tenant, seen.band, seen.weight, active),
        }
    return {
        "min_slots": size.min_slots,
        "max_slots": size.max_slots,
        "margin": size.margin,
        "sized": size.sized,
        "free_slots": free,
        "kept": reserve_for("", lowest, active, size),
        "tenants": tenants,
    }

"""A pool's batch slots under flow control: is the pool saturated, which free slots are kept (for tenants
under their share, and inside a tenant for its programs under theirs), and which running stream gives
its slot to a waiting request.

Work-conserving by default: a request waits only while no endpoint could start it now. The slot reserves
and preemption trade a little of that for a light tenant's (or a small program's) latency beside a
flood; gateway.yaml's `flow_control` section (`FlowSettings`, at the end) sets all of them per pool.
Each decision is a pure function of counts the gateway keeps (`gateway/flow/`).

Saturation
----------

Is a pool saturated: could any of its endpoints start one more request now?

Work-conserving: a request waits in the gateway only while *no* endpoint could start it now. One
endpoint cannot when any of these holds (each limit optional):

- the engine's waiting queue is over `max_engine_waiting`. The engine's own count is scraped (and
  lags); the gateway's in-flight count on the endpoint is exact but only its own, so the queue is
  taken as the larger of the scraped `waiting` and what the in-flight requests, this one included,
  would leave over the engine's batch size (`max_num_seqs`, when the pool states it): with
  `max_engine_waiting: 0` a request goes only while the batch has a free slot;
- the engine's KV-cache usage is over `max_kv_usage_ratio`;
- the gateway's own in-flight requests there reach `max_inflight`;
- the request's predicted TTFT there is over `max_predicted_ttft_ms` (the pool's threshold; the
  request's own objective is the SLO gate's business).

These are the Gateway API Inference Extension's saturation signals (queue depth, KV utilisation;
its defaults are 5 and 0.8, `pkg/epp/saturationdetector/config.go`). Stale engine metrics are not
read: with no fresh scrape only the gateway's own in-flight count speaks, so a pool whose engines
export no metrics is never held up by numbers it does not have.

The slot reserve
----------------

Slot reserve: a few free batch slots kept for tenants under their share of what is in flight.

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
its predicted TTFT when the router predicted one, see `gateway/request/director.py`.)

The program slot reserve
------------------------

Program slot reserve: an endpoint's last free batch slots kept, inside one tenant, for its programs
under their share while a wide program of the same tenant runs beside them.

Program-fair queueing (`order.py`) decides who *waits* least; it cannot make a small program's
calls run fast once they start. On an engine every sequence of a batch pays for the others: a decode
step reads every running sequence's KV cache, so with the batch full of a wide program's long
contexts each token of a one-call program takes longer (`backends/perf/roofline.py`, Llama-3.1-8B on
an H100 at 8K contexts: 7.3 ms a step alone, 11.8 ms at a batch of 8), and the wide program's next
prompts are prefilled in the same steps. The tenant slot reserve (above) keeps slots free for
*tenants* under their share; inside one tenant everything is one flood to it.

With `program_reserve_slots: k` (per pool, gateway.yaml; 0: off) and program fairness on for the
tenant, a request of a program that would hold, after it, more than an equal share of its tenant's
requests in flight in the pool (`over_share`) may start only on an endpoint that keeps at least `k`
free slots after it (`keeps_reserve`), and only while another program of the tenant is light
(`light_others`: active in the pool and nothing of it waiting, so the slots are kept for its next
call; a program with calls waiting is served by the room's order, least attained service first). The
engines that serve the small programs' calls thus run batches of at most `max_num_seqs - k` of the
wide program's sequences, and a small program's next call finds a free slot at once. The cost is
those slots left to the small programs while they are active: the wide program's share of the pool
shrinks by `k` per endpoint, and nothing more once they are done (`program_active_s` after their
last call).

Equal shares: programs have no weights of their own; the tenant's weight is the tenants' business.
Every input here is a count the caller keeps up to date (`gateway/flow/activity.py`), so a
decision is a few integer comparisons, never a walk over the tenant's programs.

Preemption
----------

Preemption: which running stream gives its batch slot to a waiting request under its share.

Without it a light tenant whose request finds the pool full waits until some request ends, however
fair the order of the waiting room: with the flood's requests generating long outputs that wait is
a good part of one of them. The slot reserve (above) keeps a few slots free for such a
request, but it is sized from recent demand and a burst beyond it still waits. So with `preempt` a
request that finds the pool full while its tenant is under its share of the band's slots takes one
from a tenant over its share: flow control cuts one of that tenant's plain streams, the stream waits
its turn in the waiting room again, and then continues where it stopped (the prompt plus the text
sent so far, `gateway/upstream/replica_loss.py`: the client sees one stream, billed once). That is the engine's
own recompute preemption, done a level up, and it costs the cut request the recompute of its
prefix.

`victim` is the choice, a pure function:

- only a tenant of the same band or a lower one is cut; a lower band's first (strict priority);
- in the same band only a tenant holding more slots per unit of weight than the waiter's tenant
  would hold after taking one, so a swap never invites the swap back;
- or, in the same band, a backlogged tenant (requests waiting) that received at least its weighted
  share of the band's service lately, when the waiter's tenant received less (`under_share`, from
  `order.ServiceWindow`: tokens, what the virtual counters charge). Slots are not tokens: a light
  tenant's burst may hold more than its share of slots for a few seconds while it asks far less
  than its share of tokens, and without this it waits for the flood to finish a request. A swap
  back is no risk here: a backlogged tenant's requests, and a cut stream waiting again, never cut
  (`gateway/flow/checks.py`); a tenant that sends more and more reaches its share of tokens and stops
  cutting;
- among those, the tenant furthest over (slots per weight), and its most recent stream, which has
  the least to recompute.

gateway.yaml's flow_control section
-----------------------------------

gateway.yaml's `flow_control` section: when a pool counts as saturated, and how much may wait.

```yaml
flow_control:
  enabled: true                  # false: saturation holds nothing (the gate's other checks still may)
  saturation:                    # every pool, unless its own entry below overrides a field
    max_engine_waiting: 5        # requests waiting inside one engine
    max_kv_usage_ratio: 0.8
    max_inflight: null           # the gateway's own in-flight requests per endpoint
    max_predicted_ttft_ms: null  # the pool's TTFT threshold
    reserve_slots: 0             # free batch slots kept for tenants under their share (0: none)
    reserve_max_slots: null      # above reserve_slots: sized from their recent peak demand, up to this
    reserve_margin: 1            # with reserve_max_slots: slots kept beyond that peak
    reserve_avoid_prefills: true # with a reserve: those it is kept for go where no prefill is pending
    preempt: false               # a request finding the pool full may cut a stream of a tenant over its share
    reserve_clear_lane: false    # with a reserve: those over their share start only where no prefill is
                                 # pending, and only while another endpoint with a free slot has none either
    program_reserve_slots: 0     # per endpoint, inside a tenant with program fairness: a program over its
                                 # share may not take the last N free slots while another program is light
  max_queued: 1024               # per pool, requests waiting in the gateway
  max_queued_bytes: 67108864     # per pool, their request bodies
  reserve_active_s: 60           # a tenant keeps its claim on the reserve (and its peak) this long
  program_active_s: 10           # a program keeps its claim on the program reserve this long
  pools:
    llama: {saturation: {max_engine_waiting: 0}, max_queued: 256}
```

Tenant weights and per-band waiting limits are policy (policies.yaml `flow_control`), hot-reloaded;
this section describes the machines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

from backends.types import Endpoint
from policies.flow.order import BANDS, band_name


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


REASON_ENGINE_QUEUE: Final = "engine_queue"
REASON_KV_USAGE: Final = "kv_usage"
REASON_INFLIGHT: Final = "inflight"
REASON_PREDICTED_TTFT: Final = "predicted_ttft"


@dataclass(frozen=True, slots=True)
class SaturationLimits:
    """A pool's limits (None: not checked). `max_num_seqs` is the engine's batch size, when known;
    `reserve_slots` free slots (up to `reserve_max_slots`, sized from recent demand) are kept for
    tenants under their share (the slot reserve)."""

    max_engine_waiting: int | None = 5
    max_kv_usage_ratio: float | None = 0.8
    max_inflight: int | None = None
    max_predicted_ttft_ms: float | None = None
    max_stats_age_s: float = 2.0
    reserve_slots: int = 0  # policies.flow.saturation
    max_num_seqs: int | None = None
    reserve_max_slots: int | None = None  # above reserve_slots: sized from recent demand
    reserve_margin: int = 1
    reserve_avoid_prefills: bool = True
    preempt: bool = False  # policies.flow.saturation
    reserve_clear_lane: bool = False  # policies.flow.saturation.clear_lane
    program_reserve_slots: int = 0  # policies.flow.saturation: per endpoint, inside a tenant

    @property
    def reserve(self) -> ReserveSize:
        return ReserveSize(self.reserve_slots, self.reserve_max_slots, self.reserve_margin)


def engine_waiting(endpoint: Endpoint, limits: SaturationLimits, now_s: float, fresh: bool | None = None) -> int:
    """Requests the engine would hold unstarted with one more: the scraped queue, or what the
    gateway's own in-flight requests and this one leave over the batch size. `fresh`: whether the
    scrape is within `max_stats_age_s`, when the caller knows (else it is read here)."""
    implied = endpoint.inflight.requests + 1 - limits.max_num_seqs if limits.max_num_seqs else 0
    if fresh is None:
        fresh = endpoint.stats_age_s(now_s) <= limits.max_stats_age_s
    if not fresh:
        return max(implied, 0)
    return max(endpoint.engine_waiting(), implied, 0)


def endpoint_saturation(
    endpoint: Endpoint, limits: SaturationLimits, now_s: float, predicted_ttft_ms: float | None = None
) -> str | None:
    """Why `endpoint` cannot start one more request now (a reason label), or None when it can."""
    if limits.max_inflight is not None and endpoint.inflight.requests >= limits.max_inflight:
        return REASON_INFLIGHT
    fresh = endpoint.stats_age_s(now_s) <= limits.max_stats_age_s  # read once for both bounds
    if (
        limits.max_engine_waiting is not None
        and engine_waiting(endpoint, limits, now_s, fresh) > limits.max_engine_waiting
    ):
        return REASON_ENGINE_QUEUE
    if fresh and limits.max_kv_usage_ratio is not None and endpoint.stats.kv_usage_ratio > limits.max_kv_usage_ratio:
        return REASON_KV_USAGE
    threshold = limits.max_predicted_ttft_ms
    if threshold is not None and predicted_ttft_ms is not None and predicted_ttft_ms > threshold:
        return REASON_PREDICTED_TTFT
    return None


def open_endpoints(
    endpoints: Iterable[Endpoint],
    limits: SaturationLimits,
    now_s: float,
    predicted_ttft_ms: Mapping[str, float] | None = None,
) -> list[Endpoint]:
    """The ready endpoints that could start a request now; empty means the pool is saturated."""
    predicted = predicted_ttft_ms or {}
    return [e for e in endpoints if e.ready and endpoint_saturation(e, limits, now_s, predicted.get(e.id)) is None]


def saturation_reasons(endpoints: Iterable[Endpoint], limits: SaturationLimits, now_s: float) -> dict[str, str | None]:
    """Endpoint id -> why it is saturated (None: it is not), for status pages."""
    return {e.id: endpoint_saturation(e, limits, now_s) for e in endpoints if e.ready}


@dataclass(frozen=True, slots=True)
class Standing:
    """A program's place in its tenant, in one pool: its requests in flight, the tenant's, the
    tenant's programs active there (the program itself counted), and how many of the others are light
    (active, nothing waiting)."""

    inflight: int
    tenant_inflight: int
    active: int
    light_others: int


def over_share(standing: Standing) -> bool:
    """Whether, after one more request, the program would hold more than an equal share of its
    tenant's requests in flight: `(own + 1) * programs > tenant + 1`."""
    return (standing.inflight + 1) * max(standing.active, 1) > standing.tenant_inflight + 1


def held(standing: Standing) -> bool:
    """Whether the program reserve applies to the program's next request: it is over its share and
    another program of its tenant is light, so that the reserve is kept for someone."""
    return standing.light_others > 0 and over_share(standing)


def keeps_reserve(free_slots: int, reserve_slots: int) -> bool:
    """Whether an endpoint with `free_slots` keeps `reserve_slots` free after one more request."""
    return free_slots - 1 >= reserve_slots


@dataclass(frozen=True, slots=True)
class Running:
    """A stream flow control may cut: an opaque key, its tenant and band, when it was dispatched."""

    key: int
    tenant: str
    band: int
    dispatched_s: float


def victim(
    tenant: str,
    band: int,
    weight: float,
    running: Iterable[Running],
    active: Mapping[str, Active],
    ratios: Mapping[str, float] | None = None,
) -> Running | None:
    """The stream to cut so that a request of `tenant` (in `band`, `weight`) may start, or None.

    `ratios`: each tenant's recent service in the band over its weighted share of it (1.0 exactly
    its share; `order.fair_share_ratios`), or None to judge by slots alone."""
    ratios = ratios or {}
    under_share = ratios.get(tenant, 0.0) < 1.0 if ratios else False
    own = active.get(tenant)
    need = ((own.inflight if own is not None else 0) + 1) / max(weight, 1e-9)
    best: tuple[int, float, float] | None = None
    chosen: Running | None = None
    for stream in running:
        if stream.tenant == tenant or stream.band < band:
            continue
        seen = active.get(stream.tenant)
        if seen is None:
            continue
        per_weight = seen.inflight / max(seen.weight, 1e-9)
        if stream.band == band and per_weight <= need:
            backlogged_over = seen.waiting > 0 and ratios.get(stream.tenant, 0.0) >= 1.0
            if not (under_share and backlogged_over):
                continue
        rank = (stream.band, per_weight, stream.dispatched_s)
        if best is None or rank > best:
            best, chosen = rank, stream
    return chosen


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SaturationConfig(_Strict):
    max_engine_waiting: int | None = Field(default=5, ge=0, description="waiting requests in one engine")
    max_kv_usage_ratio: float | None = Field(default=0.8, gt=0, le=1, description="KV-cache usage of one engine")
    max_inflight: int | None = Field(default=None, ge=1, description="gateway's own in-flight requests per endpoint")
    max_predicted_ttft_ms: float | None = Field(default=None, gt=0, description="the pool's TTFT threshold")
    max_stats_age_s: float = Field(default=2.0, gt=0, description="older engine metrics are not read")
    reserve_slots: int = Field(
        default=0, ge=0, description="free batch slots kept for tenants under their share (needs max_num_seqs)"
    )
    reserve_max_slots: int | None = Field(
        default=None,
        ge=0,
        description="above reserve_slots: the reserve follows those tenants' recent peak demand, up to this",
    )
    reserve_margin: int = Field(
        default=1, ge=0, description="slots kept beyond that recent peak (with reserve_max_slots)"
    )
    reserve_avoid_prefills: bool = Field(
        default=True,
        description="with a reserve: a request it is kept for goes where no prefill is pending, if open",
    )
    preempt: bool = Field(
        default=False,
        description=(
            "a request that finds the pool full cuts a plain stream of a tenant over its share, which waits"
            " its turn and continues where it stopped (policies/flow/saturation.py)"
        ),
    )

    reserve_clear_lane: bool = Field(
        default=False,
        description=(
            "with a reserve: a request over its share (or over its weighted share of the band's recent tokens"
            " beside a tenant under it) starts only on an endpoint with no prefill pending, and only while"
            " another endpoint with a free slot has none pending either (policies/flow/saturation.py)"
        ),
    )
    program_reserve_slots: int = Field(
        default=0,
        ge=0,
        description=(
            "per endpoint, inside a tenant with program fairness: a program over its share of the tenant's"
            " requests in flight may not take an endpoint's last N free batch slots while another of the"
            " tenant's programs is active and has nothing waiting (needs max_num_seqs;"
            " policies/flow/saturation.py)"
        ),
    )


class PoolFlowConfig(_Strict):
    saturation: SaturationConfig | None = Field(default=None, description="fields set here override the defaults")
    max_queued: int | None = Field(default=None, ge=1, description="this pool's max_queued")
    max_queued_bytes: int | None = Field(default=None, ge=1024, description="this pool's max_queued_bytes")


class FlowAdvanced(_Strict):
    """`flow_control.advanced`: the waiting rooms' timers. They trade CPU and Redis calls for how soon a
    freed slot is seen; a change is a benchmark's decision (bench/fairness), not a deployment's."""

    recheck_ms: float = Field(default=50.0, gt=0, description="the head of a waiting room rechecks this often")
    counters_refresh_ms: float = Field(
        default=100.0, gt=0, description="Redis counters: re-read this often while requests wait"
    )
    counters_flush_ms: float = Field(
        default=5.0, gt=0, description="Redis counters: changes gather this long, then go out in one call per band"
    )


class FlowSettings(_Strict):
    enabled: bool = Field(default=True, description="hold requests while their pool is saturated")
    saturation: SaturationConfig = Field(
        default_factory=SaturationConfig,
        description="when an endpoint can start no more (every pool, unless its own entry overrides a field)",
    )
    max_queued: int = Field(default=1024, ge=1, description="requests waiting per pool")
    max_queued_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description="their bodies, per pool")
    share_window_s: float = Field(default=60.0, gt=0, description="window of tokenway_fair_share_ratio")
    reserve_active_s: float = Field(
        default=60.0,
        gt=0,
        description="a tenant keeps its claim on the slot reserve this long after its last request (and its peak)",
    )
    program_active_s: float = Field(
        default=10.0,
        gt=0,
        description="a program keeps its claim on the program slot reserve this long after its last request",
    )
    pools: dict[str, PoolFlowConfig] = Field(
        default_factory=dict, description="per pool: overrides of saturation and the room sizes"
    )
    advanced: FlowAdvanced = Field(
        default_factory=FlowAdvanced, description="expert tunables: how often waiting rooms and counters look again"
    )

    def limits(self, pool: str, max_num_seqs: int | None = None) -> SaturationLimits:
        """The pool's saturation limits: its own fields over the defaults; all off when disabled."""
        if not self.enabled:
            return SaturationLimits(
                None, None, None, None, self.saturation.max_stats_age_s, 0, max_num_seqs, None, 1, False
            )
        merged = self.saturation.model_dump()
        override = self.pools.get(pool)
        if override is not None and override.saturation is not None:
            merged.update({k: getattr(override.saturation, k) for k in override.saturation.model_fields_set})
        return SaturationLimits(**merged, max_num_seqs=max_num_seqs)

    def program_reserve_on(self) -> bool:
        """Whether any pool keeps a program slot reserve (only then are program counts shared)."""
        if not self.enabled:
            return False
        pools = (o.saturation for o in self.pools.values() if o.saturation is not None)
        return self.saturation.program_reserve_slots > 0 or any(
            "program_reserve_slots" in s.model_fields_set and s.program_reserve_slots > 0 for s in pools
        )

    def room(self, pool: str) -> tuple[int, int]:
        """(max_queued, max_queued_bytes) of the pool's waiting room."""
        override = self.pools.get(pool)
        count = override.max_queued if override is not None and override.max_queued is not None else self.max_queued
        size = self.max_queued_bytes
        if override is not None and override.max_queued_bytes is not None:
            size = override.max_queued_bytes
        return count, size

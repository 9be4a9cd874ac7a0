"""Preemption: which running stream gives its batch slot to a waiting request under its share.

Without it a light tenant whose request finds the pool full waits until some request ends, however
fair the order of the waiting room: with the flood's requests generating long outputs that wait is
a good part of one of them. The slot reserve (`reserve.py`) keeps a few slots free for such a
request, but it is sized from recent demand and a burst beyond it still waits. So with `preempt` a
request that finds the pool full while its tenant is under its share of the band's slots takes one
from a tenant over its share: flow control cuts one of that tenant's plain streams, the stream waits
its turn in the waiting room again, and then continues where it stopped (the prompt plus the text
sent so far, `gateway/upstream/migrate.py`: the client sees one stream, billed once). That is the engine's
own recompute preemption, done a level up, and it costs the cut request the recompute of its
prefix.

`victim` is the choice, a pure function:

- only a tenant of the same band or a lower one is cut; a lower band's first (strict priority);
- in the same band only a tenant holding more slots per unit of weight than the waiter's tenant
  would hold after taking one, so a swap never invites the swap back;
- or, in the same band, a backlogged tenant (requests waiting) that received at least its weighted
  share of the band's service lately, when the waiter's tenant received less (`under_share`, from
  `share.ServiceWindow`: tokens, what the virtual counters charge). Slots are not tokens: a light
  tenant's burst may hold more than its share of slots for a few seconds while it asks far less
  than its share of tokens, and without this it waits for the flood to finish a request. A swap
  back is no risk here: a backlogged tenant's requests, and a cut stream waiting again, never cut
  (`gateway/flow/saturation.py`); a tenant that sends more and more reaches its share of tokens and stops
  cutting;
- among those, the tenant furthest over (slots per weight), and its most recent stream, which has
  the least to recompute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from policies.flow.reserve import Active


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
    its share; `share.fair_share_ratios`), or None to judge by slots alone."""
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

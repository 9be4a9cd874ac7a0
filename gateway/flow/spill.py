"""Spill-over: a model's owned pools first, its overflow pools (`overflow: true`, typically a hosted
API billed per token) only for what the owned ones cannot take, and back as soon as they can.

A check at the gate (`gateway/flow/check.py`), asked first. The walk routes the model's pools in
order, overflow pools last (`backends/fleet.py`), so a request reaches an overflow pool only when no
owned endpoint is left to it. This check's verdict on a route:

- on an owned pool of a model that has an overflow pool: GO, unless the request has waited in the
  owned pool's room longer than `spill.max_wait_ms`, or that room holds `spill.max_waiting` requests
  already, or (with `spill.usd_per_wait_second`) its predicted further wait there is worth more than
  what the dearest overflow pool costs it more (`policies/spill.py`); then `Avoid` every owned
  endpoint of the model (the room routes again, to the overflow pool), otherwise GO (no overflow
  endpoint is ready: it stays);
- on an overflow pool: GO when the tenant may spill (`tenants.<t>.spill.allowed`, and its spill
  spend this UTC day under `spill.usd_per_day`, this replica's share of it with `admission.replicas`
  replicas), else `Avoid` it and wait (`Wait(REQUEST)`) for owned capacity. Batch lines never spill.

So the three reasons a request spills are one mechanism: its owned pool's room is over budget (this
check), the SLO check avoided every owned endpoint (it cannot meet the request's SLO there), or the
owned pools are down (no route to them). Each ask routes the owned pools again first, so the moment
capacity returns, requests stay home. Spilled requests are counted on their pool like any other
(`tokenway_tokens_total{pool}`, `tokenway_cost_usd_total{pool}`, the ledger's `pool`); the ledger's
`extra.spill` says why one spilled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from backends.fleet import Fleet, Pool
from gateway.flow.check import GO, Avoid, Check, Turn, Verdict, Wait
from gateway.flow.queue import FlowQueue
from gateway.flow.types import Blocked
from gateway.request import Hook, RequestContext, Routed
from policies.holder import PolicyHolder
from policies.schema import TenantSpillConfig
from policies.spill import extra_usd, worth_spilling

_REFUSED: Final = Wait(Blocked.REQUEST, "spill_refused")
_DEFAULT: Final = TenantSpillConfig()
_MAX_TENANTS: Final = 100_000  # spend counters kept (tenants may be made at run time): the oldest day goes first
REASON_WAITED: Final = "waited"  # over spill.max_wait_ms in the owned pool's room
REASON_CROWDED: Final = "crowded"  # the owned pool's room held spill.max_waiting
REASON_NO_ROUTE: Final = "owned_unavailable"  # no owned endpoint left to it (down, or the SLO check avoided them)
REASON_PRICED: Final = "wait_costlier"  # its predicted wait x spill.usd_per_wait_second > the overflow's extra $


def is_overflow(pool: Pool) -> bool:
    return pool.config.overflow


@dataclass(slots=True)
class Spill(Check, Hook):
    queue: FlowQueue
    policies: PolicyHolder
    fleet: Fleet
    now: Callable[[], float] = field(default=time.monotonic)
    wall: Callable[[], float] = field(default=time.time)
    _spent: dict[str, tuple[int, float]] = field(default_factory=dict)  # tenant -> (UTC day number, USD)

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        ctx = turn.ctx
        pools = self.fleet.pools_for_model(ctx.model)
        if not pools or not is_overflow(pools[-1]):  # overflow pools sort last: none for this model
            return GO
        if is_overflow(routed.pool):
            if self.may_spill(ctx):
                if ctx.record.spill is None:
                    ctx.record.spill = REASON_NO_ROUTE
                return GO
            return Avoid([e.id for e in routed.pool.endpoints], _REFUSED)
        reason = self._over_budget(turn, routed.pool, pools)
        if reason is None or not self.may_spill(ctx):
            return GO
        ctx.record.spill = reason
        owned = [e.id for pool in pools if not is_overflow(pool) for e in pool.endpoints]
        return Avoid(owned, GO)

    def went(self, turn: Turn, routed: Routed) -> None:
        if not is_overflow(routed.pool):
            turn.ctx.record.spill = None  # it stays home after all (no overflow endpoint was ready)

    def finished(self, ctx: RequestContext) -> None:
        """A request served on an overflow pool counts against its tenant's spill cap."""
        record = ctx.record
        if record.spill is None or not record.cost_usd:
            return
        day = int(self.wall() // 86_400)
        tenant = record.tenant
        held = self._spent.get(tenant)
        spent = held[1] if held is not None and held[0] == day else 0.0
        if held is None and len(self._spent) >= _MAX_TENANTS:
            self._spent.pop(min(self._spent, key=lambda t: self._spent[t][0]))
        self._spent[tenant] = (day, spent + record.cost_usd)

    def may_spill(self, ctx: RequestContext) -> bool:
        if ctx.facts.batch_id is not None:
            return False
        config = self.policies.current.config
        found = config.tenants.get(ctx.facts.principal.tenant)
        spill = found.spill if found is not None else _DEFAULT
        if not spill.allowed:
            return False
        if spill.usd_per_day is None:
            return True
        return self.spent_today(ctx.facts.principal.tenant) < spill.usd_per_day / config.admission.replicas

    def spent_today(self, tenant: str) -> float:
        """USD this replica sent to overflow pools for `tenant` this UTC day."""
        held = self._spent.get(tenant)
        return held[1] if held is not None and held[0] == int(self.wall() // 86_400) else 0.0

    def _over_budget(self, turn: Turn, pool: Pool, pools: Sequence[Pool]) -> str | None:
        policy = self.policies.current.config.spill
        if (self.now() - turn.began_s) * 1000.0 > policy.max_wait_ms:
            return REASON_WAITED
        if policy.max_waiting is not None and self.queue.depth(pool.name) >= policy.max_waiting:
            return REASON_CROWDED
        if policy.usd_per_wait_second is not None and self._wait_costlier(
            turn, pool, pools, policy.usd_per_wait_second
        ):
            return REASON_PRICED
        return None

    def _wait_costlier(self, turn: Turn, pool: Pool, pools: Sequence[Pool], usd_per_s: float) -> bool:
        """The priced bound: the room's predicted wait against the overflow's extra dollars for this
        request (its prompt and predicted output), at the dearest overflow pool it may be sent to."""
        wait_s = self.queue.predicted_wait_s(pool.name, turn.request.band, held=turn.last_wait is not None)
        if not wait_s:  # nobody ahead, or no rate to predict by: only the fixed bounds decide
            return False
        ctx = turn.ctx
        policy = self.policies.current
        facts = ctx.facts
        output = round(ctx.output_prediction.tokens) if ctx.output_prediction is not None else facts.output_reservation
        owned = policy.price(ctx.model, pool.name)
        extra = max(
            extra_usd(owned, policy.price(ctx.model, p.name), facts.prompt_tokens, output)
            for p in pools
            if is_overflow(p)
        )
        return worth_spilling(wait_s, usd_per_s, extra)

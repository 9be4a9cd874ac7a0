"""Redis with a safety net: breaker, fail-open or fail-closed, replay without double counting, and the
mirror of the last state Redis reported.

The mirror belongs to the failover store: it seeds fail-open, rejects early and feeds the gauges.

Failover
--------

Redis with a safety net: breaker, fail-open or fail-closed, and replay without double counting.

- Healthy: every reservation is one Redis script; the mirror may reject early, never admit.
- Redis failing: the breaker opens after a few consecutive errors, so later requests do not wait on
  it. `fail_closed` raises `StoreUnavailable` (the gateway answers 503); `fail_open` admits from a
  local `MemoryStore` holding this replica's share (limits / replicas), seeded from the mirror.
- Recovery: the first successful probe closes the breaker and discards the local buckets. Tickets
  keep the source that admitted them: local ones settle locally (Redis never saw their reservation)
  and their real cost is charged to Redis budgets once, under a marker; Redis tickets whose
  settlement failed are replayed from a bounded queue, and the script's ticket check makes a replay
  of an already-applied settlement a no-op.
- Ambiguous failures: an error from a reservation (a timeout above all) does not say whether the
  script ran, or will run once a stalled Redis resumes. Before the policy decides, the ticket is
  voided (`void.lua`: refunded if it ran, refused if it runs later), inline when the breaker still
  lets calls through, else from the replay queue; a reservation that succeeds on a retry after a
  successful void is used as usual. So neither a fail-open local admission nor a fail-closed 503
  leaves a charge, a lease or a ticket behind in Redis.
- The breaker counts failures, not failed commands: the commands of one connection that timed out
  (or one batch) share one exception, which counts once, so a single stall of Redis under load
  cannot trip it by itself (each failed reservation is still voided and retried as above).
- Replay does not wait for the next request: while anything is queued a task retries it, paced by
  the breaker. Any success after local admissions (not only the breaker closing) discards the local
  buckets, so a later short failure starts from what Redis reported since, never from stale numbers.

The mirror
----------

This replica's copy of the last state Redis reported for each bucket and budget it touched.

It serves three purposes without extra round trips: an early local rejection when a bucket is known to
be short (`precheck`: the local side may reject, it never admits), the seed of the fail-open buckets
(this replica's 1/N share of what was used, so an outage does not hand out a fresh full limit), and
the per-bucket gauges of /admin/status. Entries are corrected by this replica's own settlements;
other replicas' refunds are unseen, which is why a precheck only trusts an entry for `max_age_s`.

All times are on the store's clock (Redis TIME, estimated locally by `FailoverStore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import RedisError

from policies.limits import memory_store
from policies.limits.admission import Store
from policies.limits.memory_store import MemoryStore, RunSeen, bucket_row, budget_row
from policies.limits.plan import BucketSpec, BudgetSpec, Charge, Outcome, Plan, Settlement, StoreUnavailable
from policies.limits.redis_store import RedisStore, VoidedTicket


@dataclass(slots=True)
class _Seen:
    used: float
    at_s: float
    spec: BucketSpec


@dataclass(slots=True)
class _SeenBudget:
    period: int
    spent_usd: float
    at_s: float
    spec: BudgetSpec


class Mirror:
    def __init__(self, *, max_age_s: float = 1.0) -> None:
        self.max_age_s = max_age_s
        self._buckets: dict[str, _Seen] = {}
        self._budgets: dict[str, _SeenBudget] = {}

    def record(self, plan: Plan, charge: Charge, outcome: Outcome) -> None:
        now_s = outcome.now_s
        for spec, used, cost in zip(plan.buckets, outcome.bucket_used, charge.bucket_costs, strict=True):
            self._buckets[spec.key] = _Seen(used + cost if outcome.admitted else used, now_s, spec)
        for budget_spec, spent, pid in zip(plan.budgets, outcome.budget_spent, outcome.budget_periods, strict=True):
            total = spent + charge.cost_usd if outcome.admitted else spent
            self._budgets[budget_spec.key] = _SeenBudget(pid, total, now_s, budget_spec)

    def settled(self, plan: Plan, settlement: Settlement) -> None:
        for spec, delta in zip(plan.buckets, settlement.bucket_deltas, strict=True):
            seen = self._buckets.get(spec.key)
            if seen is not None:
                seen.used = max(0.0, seen.used + delta)
        for budget_spec, pid in zip(plan.budgets, settlement.budget_periods, strict=True):
            budget = self._budgets.get(budget_spec.key)
            if budget is not None and budget.period == pid:
                budget.spent_usd = max(0.0, budget.spent_usd + settlement.budget_delta_usd)

    def used_at(self, key: str, now_s: float) -> float | None:
        seen = self._buckets.get(key)
        if seen is None:
            return None
        return memory_store.drained(seen.used, seen.at_s, now_s, seen.spec.rate_per_s)

    def precheck(self, plan: Plan, charge: Charge, now_s: float) -> Outcome | None:
        """A rejection decided from fresh mirror entries alone, or None to ask Redis."""
        short = False
        used: list[float] = []
        for spec, cost in zip(plan.buckets, charge.bucket_costs, strict=True):
            seen = self._buckets.get(spec.key)
            if seen is None or abs(now_s - seen.at_s) > self.max_age_s:
                used.append(0.0)
                continue
            u = memory_store.drained(seen.used, seen.at_s, now_s, spec.rate_per_s)
            used.append(u)
            if not spec.shadow and u + cost > spec.capacity:
                short = True
        spent: list[float] = []
        periods: list[int] = []
        for budget_spec in plan.budgets:
            budget = self._budgets.get(budget_spec.key)
            pid = memory_store.period_id(budget_spec.period, now_s)
            fresh = budget is not None and budget.period == pid and abs(now_s - budget.at_s) <= self.max_age_s
            s = budget.spent_usd if fresh and budget is not None else 0.0
            spent.append(s)
            periods.append(pid)
            if fresh and not budget_spec.shadow and s + charge.cost_usd > budget_spec.limit_usd:
                short = True
        if not short:
            return None
        return Outcome(False, now_s, used, [0] * len(plan.leases), spent, periods, "precheck")

    def seed(self, spec: BucketSpec | BudgetSpec, now_s: float) -> float | None:
        """The last known global amount, for a fail-open bucket or budget that has none yet."""
        if isinstance(spec, BucketSpec):
            return self.used_at(spec.key, now_s)
        budget = self._budgets.get(spec.key)
        if budget is None or budget.period != memory_store.period_id(spec.period, now_s):
            return None
        return budget.spent_usd

    def sweep(self, now_s: float) -> None:
        for key, seen in list(self._buckets.items()):
            rate = seen.spec.rate_per_s
            if (rate <= 0.0 and now_s - seen.at_s > 3600.0) or memory_store.drained(
                seen.used, seen.at_s, now_s, rate
            ) <= 0.0:
                del self._buckets[key]
        for key, budget in list(self._budgets.items()):
            if now_s - budget.at_s > 3600.0:
                del self._budgets[key]

    def snapshot(self, now_s: float) -> list[dict[str, Any]]:
        rows = [bucket_row(seen.spec, self.used_at(key, now_s) or 0.0, "redis") for key, seen in self._buckets.items()]
        rows += [budget_row(b.spec, b.spent_usd, "redis") for b in self._budgets.values()]
        return rows


log = logging.getLogger(__name__)

STORE_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
PENDING_MAX = 10_000
SWEEP_EVERY = 4096
REPLAY_PAUSE_S = 0.05  # between replay attempts while the breaker lets probes through

Payload = Settlement | Charge  # what a queued operation carries: a settlement, or a charge to void
State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """A circuit breaker for the shared store: after `failure_threshold` consecutive failures it opens
    and every call skips Redis (no connect attempt, no timeout) for `open_s`; then one probe is let
    through, and its success closes the breaker. Without it a dead Redis would cost each request a
    timeout."""

    def __init__(
        self, failure_threshold: int = 3, open_s: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self._clock = clock
        self.state: State = "closed"
        self.consecutive_failures = 0
        self.opened_at_s = 0.0
        self.trips = 0

    def allow(self) -> bool:
        """May this call try the store? In half-open state only the single probe may."""
        if self.state == "closed":
            return True
        if self.state == "open" and self._clock() - self.opened_at_s >= self.open_s:
            self.state = "half_open"
            return True
        return False

    def success(self) -> bool:
        """Record a success; True when this closed an open breaker (the store has recovered)."""
        recovered = self.state != "closed"
        self.state = "closed"
        self.consecutive_failures = 0
        return recovered

    def failure(self) -> None:
        self.consecutive_failures += 1
        if self.state == "half_open" or self.consecutive_failures >= self.failure_threshold:
            if self.state != "open":
                self.trips += 1
            self.state = "open"
            self.opened_at_s = self._clock()

    def retry_after_s(self) -> float:
        """Time until the next probe (what a fail-closed 503 tells the client)."""
        if self.state != "open":
            return self.open_s
        return max(0.0, self.open_s - (self._clock() - self.opened_at_s))


class FailoverStore:
    may_suspend = True

    def __init__(
        self,
        redis: RedisStore,
        *,
        breaker: CircuitBreaker | None = None,
        mirror: Mirror | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.breaker = breaker or CircuitBreaker()
        self.mirror = mirror or Mirror()
        self.local = MemoryStore(source="local", seed=self.mirror.seed, clock=lambda: self.store_now())
        self._clock = clock
        self._pending: deque[tuple[str, Plan, Payload]] = deque(maxlen=PENDING_MAX)
        self._flushing: asyncio.Task[None] | None = None
        self._ops = 0
        self._offset_s = 0.0  # Redis TIME - local clock, from the latest reply
        self._last_failure: BaseException | None = None
        self.stats = {
            "redis_errors": 0,
            "precheck_rejections": 0,
            "local_admissions": 0,
            "replayed": 0,
            "dropped_settlements": 0,
            "voided": 0,  # ambiguous reservations made void (undone if they ran)
            "voided_undone": 0,  # ... of which Redis had run (a stall after the send)
        }

    # ------------------------------------------------------------------ reserve
    async def reserve(self, plan: Plan, charge: Charge, now_s: float | None = None) -> Outcome:
        settings = plan.settings
        self.breaker.failure_threshold = settings.breaker_failures
        self.breaker.open_s = settings.breaker_open_s
        self._ops += 1
        store_now_s = self.store_now(now_s)
        if self._ops % SWEEP_EVERY == 0:
            self.mirror.sweep(store_now_s)
        if settings.local_precheck and self.breaker.state == "closed":
            early = self.mirror.precheck(plan, charge, store_now_s)
            if early is not None:
                self.stats["precheck_rejections"] += 1
                return early
        if self.breaker.allow():
            outcome = await self._reserve_redis(plan, charge, now_s)
            if outcome is not None:
                return outcome
        if not settings.fail_open:
            raise StoreUnavailable("rate limiter store unavailable", self.breaker.retry_after_s())
        self.local.scale = 1.0 / settings.replicas
        self.stats["local_admissions"] += 1
        return self.local.reserve_now(plan, charge, store_now_s)

    async def _reserve_redis(self, plan: Plan, charge: Charge, now_s: float | None) -> Outcome | None:
        """Redis's answer, or None when it failed; a failed reservation is voided before returning."""
        for attempt in range(2):
            try:
                outcome = await self.redis.reserve(plan, charge, now_s)
            except VoidedTicket:  # only a reused ticket id gets here: take a fresh one
                charge.ticket_id = _retry_id(charge.ticket_id)
                continue
            except STORE_ERRORS as exc:
                self._failed(exc)
                if not await self._void(plan, charge, now_s, inline=attempt == 0):
                    return None
                charge.ticket_id = _retry_id(charge.ticket_id)  # Redis answered the void: retry once
                continue
            if now_s is None:
                self._offset_s = outcome.now_s - self._clock()
            self._succeeded()
            self.mirror.record(plan, charge, outcome)
            return outcome
        return None

    async def _void(self, plan: Plan, charge: Charge, now_s: float | None, *, inline: bool) -> bool:
        """Undo a reservation whose outcome is unknown. True when done now (Redis answered); else it
        waits in the replay queue, which is safe in any order (a late reservation is refused)."""
        self.stats["voided"] += 1
        if inline and self.breaker.allow():
            try:
                undone = await self.redis.void(plan, charge, now_s)
            except STORE_ERRORS as exc:
                self._failed(exc)
            else:
                self.stats["voided_undone"] += int(undone)
                self._succeeded()
                return True
        self._queue("void", plan, charge)
        return False

    async def peek(self, plan: Plan, now_s: float | None = None) -> Outcome:
        """The plan's state in Redis; while Redis is unreachable, this replica's local share."""
        if self.breaker.allow():
            try:
                outcome = await self.redis.peek(plan, now_s)
            except STORE_ERRORS as exc:
                self._failed(exc)
            else:
                self._succeeded()
                return outcome
        return self.local.peek_now(plan, self.store_now(now_s))

    async def recent_runs(self, limit: int, now_s: float | None = None) -> list[RunSeen]:
        """The live agent runs Redis indexes (every replica's); while Redis is unreachable, the runs this
        replica admitted on its own."""
        if self.breaker.allow():
            try:
                found = await self.redis.recent_runs(limit, self.store_now(now_s))
            except STORE_ERRORS as exc:
                self._failed(exc)
            else:
                self._succeeded()
                return found
        return await self.local.recent_runs(limit, self.store_now(now_s))

    def store_now(self, now_s: float | None = None) -> float:
        """The store's clock: the caller's `now_s` (tests), else the local clock corrected to Redis TIME."""
        return self._clock() + self._offset_s if now_s is None else now_s

    async def abandon(self, plan: Plan, charge: Charge, now_s: float | None = None) -> None:
        """The caller of `reserve` went away while Redis was answering (a client that disconnected):
        void the ticket, which undoes the reservation if it ran and refuses it if it runs later. A
        local admission never gets here (it is made without awaiting)."""
        await self._void(plan, charge, now_s, inline=True)

    # ------------------------------------------------------------------ settle
    async def apply(self, plan: Plan, settlement: Settlement, now_s: float | None = None) -> None:
        pending = self.apply_soon(plan, settlement, now_s, lazy=False)
        if pending is not None:
            await pending

    def apply_soon(
        self, plan: Plan, settlement: Settlement, now_s: float | None = None, *, lazy: bool = True
    ) -> asyncio.Future[None] | None:
        """`apply` begun before this returns: the local state and the mirror are updated and the
        script is queued on Redis's connection (so this process's next reservation runs after it).
        The future completes once Redis answered or the settlement went to the replay queue; it never
        fails. None: nothing left to wait for."""
        if settlement.source == "local":
            if settlement.generation == self.local.generation:
                self.local.apply_now(plan, settlement, self.store_now(now_s))
            if (plan.budgets and settlement.actual_cost_usd > 0.0) or any(settlement.actual_bucket_costs):
                return self._send_soon("charge", plan, settlement, now_s, lazy)  # what it cost, counted everywhere
            return None
        self.mirror.settled(plan, settlement)
        return self._send_soon("settle", plan, settlement, now_s, lazy)

    def _send_soon(
        self, op: str, plan: Plan, settlement: Settlement, now_s: float | None, lazy: bool
    ) -> asyncio.Future[None] | None:
        if not self.breaker.allow():
            self._queue(op, plan, settlement)
            return None
        reply: asyncio.Future[Any]
        if op == "settle":
            reply = self.redis.apply_future(plan, settlement, now_s, lazy=lazy)
        else:
            reply = asyncio.ensure_future(self.redis.charge_budgets(plan, settlement, now_s))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def answered(reply: asyncio.Future[Any]) -> None:
            exc = None if reply.cancelled() else reply.exception()
            if reply.cancelled() or isinstance(exc, STORE_ERRORS):  # not known to have run: replay it
                if exc is not None:
                    self._failed(exc)
                self._queue(op, plan, settlement)
            elif exc is not None:
                log.error("%s of ticket %s failed", op, settlement.ticket_id, exc_info=exc)
            else:
                self._succeeded()
            done.set_result(None)

        reply.add_done_callback(answered)
        return done

    def _queue(self, op: str, plan: Plan, payload: Payload) -> None:
        if len(self._pending) == PENDING_MAX:
            self.stats["dropped_settlements"] += 1  # the oldest goes: its reservation drains on its own
        self._pending.append((op, plan, payload))
        self._replay_soon()

    async def _call(self, op: str, plan: Plan, payload: Payload, now_s: float | None) -> None:
        if isinstance(payload, Charge):
            self.stats["voided_undone"] += int(await self.redis.void(plan, payload, now_s))
        elif op == "settle":
            await self.redis.apply(plan, payload, now_s)
        else:
            await self.redis.charge_budgets(plan, payload, now_s)

    # ------------------------------------------------------------------ health
    def _failed(self, exc: BaseException) -> None:
        self.stats["redis_errors"] += 1
        if exc is self._last_failure:  # one lost connection or batch, seen by each command on it
            return
        self._last_failure = exc
        was = self.breaker.state
        self.breaker.failure()
        if was != "open" and self.breaker.state == "open":
            log.warning("redis limiter store unavailable, breaker open: %s", exc)

    def _succeeded(self) -> None:
        if self.breaker.success():
            log.warning("redis limiter store back: shared limiting resumes")
        if self.local.holds_state():  # a local episode is over, however short: forget its numbers
            self.local.clear()
        self._replay_soon()

    def _replay_soon(self) -> None:
        if self._pending and (self._flushing is None or self._flushing.done()):
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Replay queued operations until none is left; each is idempotent in Redis, so a lost reply
        costs nothing. Paced by the breaker: while it is open, wait for its next probe."""
        while self._pending:
            if not self.breaker.allow():
                await asyncio.sleep(max(REPLAY_PAUSE_S, self.breaker.retry_after_s()))
                continue
            op, plan, payload = self._pending[0]
            try:
                await self._call(op, plan, payload, None)
            except STORE_ERRORS as exc:
                self._failed(exc)
                await asyncio.sleep(REPLAY_PAUSE_S)
                continue
            if self._pending and self._pending[0][2] is payload:
                self._pending.popleft()
            self.stats["replayed"] += 1
            if self.breaker.success():
                log.warning("redis limiter store back: shared limiting resumes")
            if self.local.holds_state():
                self.local.clear()

    async def drain(self) -> None:
        """Wait for a replay in progress (tests, shutdown)."""
        if self._flushing is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._flushing

    async def close(self) -> None:
        if self._flushing is not None and not self._flushing.done():
            self._flushing.cancel()
        await self.redis.close()

    def snapshot(self) -> list[dict[str, Any]]:
        now_s = self.store_now()
        return self.mirror.snapshot(now_s) + self.local.snapshot(now_s)

    def status(self) -> dict[str, Any]:
        return {
            "store": "redis",
            "breaker": self.breaker.state,
            "breaker_trips": self.breaker.trips,
            "consecutive_failures": self.breaker.consecutive_failures,
            "pending_settlements": sum(1 for op, _, _ in self._pending if op != "void"),
            "pending_voids": sum(1 for op, _, _ in self._pending if op == "void"),
            **self.stats,
        }


def _retry_id(ticket_id: str) -> str:
    """A fresh ticket id for a retry (the voided one can never be reserved again)."""
    return ticket_id + "r"


def make_store(redis_url: str | None, *, prefix: str = "tokenway", timeout_s: float = 0.1) -> Store:
    """The store the gateway's state setting asks for: `MemoryStore` without a URL (one process); else
    Redis behind the breaker and fail-open/closed handling.

    `timeout_s` bounds each Redis call (connect and read): it is the most a failing Redis can add to
    a request before the breaker opens.
    """
    if not redis_url:
        return MemoryStore()
    return FailoverStore(RedisStore.from_url(redis_url, prefix=prefix, timeout_s=timeout_s))

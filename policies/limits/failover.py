"""Redis with a safety net: breaker, fail-open or fail-closed, and replay without double counting.

- Healthy: every reservation is one Redis script; the mirror may reject early, never admit.
- Redis failing: the breaker opens after a few consecutive errors, so later requests do not wait on
  it. `fail_closed` raises `StoreUnavailable` (the gateway answers 503); `fail_open` admits from a
  local `MemoryStore` holding this replica's share (limits / replicas), seeded from the mirror.
- Recovery: the first successful probe closes the breaker and discards the local buckets. Tickets
  keep the source that admitted them: local ones settle locally (Redis never saw their reservation)
  and their real cost is charged to Redis budgets once, under a marker; Redis tickets whose
  settlement failed are replayed from a bounded queue, and the script's ticket check makes a replay
  of an already-applied settlement a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from policies.limits.breaker import CircuitBreaker
from policies.limits.memory_store import MemoryStore
from policies.limits.mirror import Mirror
from policies.limits.redis_store import RedisStore
from policies.limits.types import Charge, Outcome, Plan, Settlement, StoreUnavailable

log = logging.getLogger(__name__)

STORE_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
PENDING_MAX = 10_000
SWEEP_EVERY = 4096


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
        self._pending: deque[tuple[str, Plan, Settlement]] = deque(maxlen=PENDING_MAX)
        self._flushing: asyncio.Task[None] | None = None
        self._ops = 0
        self._offset_s = 0.0  # Redis TIME - local clock, from the latest reply
        self.stats = {
            "redis_errors": 0,
            "precheck_rejections": 0,
            "local_admissions": 0,
            "replayed": 0,
            "dropped_settlements": 0,
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
            try:
                outcome = await self.redis.reserve(plan, charge, now_s)
            except STORE_ERRORS as exc:
                self._failed(exc)
            else:
                if now_s is None:
                    self._offset_s = outcome.now_s - self._clock()
                self._succeeded()
                self.mirror.record(plan, charge, outcome)
                return outcome
        if not settings.fail_open:
            raise StoreUnavailable("rate limiter store unavailable", self.breaker.retry_after_s())
        self.local.scale = 1.0 / settings.replicas
        self.stats["local_admissions"] += 1
        return self.local.reserve_now(plan, charge, store_now_s)

    def store_now(self, now_s: float | None = None) -> float:
        """The store's clock: the caller's `now_s` (tests), else the local clock corrected to Redis TIME."""
        return self._clock() + self._offset_s if now_s is None else now_s

    # ------------------------------------------------------------------ settle
    async def apply(self, plan: Plan, settlement: Settlement, now_s: float | None = None) -> None:
        if settlement.source == "local":
            if settlement.generation == self.local.generation:
                self.local.apply_now(plan, settlement, self.store_now(now_s))
            if plan.budgets and settlement.actual_cost_usd > 0.0:
                await self._send("charge", plan, settlement, now_s)
            return
        self.mirror.settled(plan, settlement)
        await self._send("settle", plan, settlement, now_s)

    async def _send(self, op: str, plan: Plan, settlement: Settlement, now_s: float | None) -> None:
        if not self.breaker.allow():
            self._queue(op, plan, settlement)
            return
        try:
            await self._call(op, plan, settlement, now_s)
        except STORE_ERRORS as exc:
            self._failed(exc)
            self._queue(op, plan, settlement)
        else:
            self._succeeded()

    def _queue(self, op: str, plan: Plan, settlement: Settlement) -> None:
        if len(self._pending) == PENDING_MAX:
            self.stats["dropped_settlements"] += 1  # the oldest goes: its reservation drains on its own
        self._pending.append((op, plan, settlement))

    async def _call(self, op: str, plan: Plan, settlement: Settlement, now_s: float | None) -> None:
        if op == "settle":
            await self.redis.apply(plan, settlement, now_s)
        else:
            await self.redis.charge_budgets(plan, settlement, now_s)

    # ------------------------------------------------------------------ health
    def _failed(self, exc: BaseException) -> None:
        self.stats["redis_errors"] += 1
        was = self.breaker.state
        self.breaker.failure()
        if was != "open" and self.breaker.state == "open":
            log.warning("redis limiter store unavailable, breaker open: %s", exc)

    def _succeeded(self) -> None:
        if self.breaker.success():
            log.warning("redis limiter store back: shared limiting resumes")
            self.local.clear()
        if self._pending and (self._flushing is None or self._flushing.done()):
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Replay queued settlements; each is idempotent in Redis, so a lost reply costs nothing."""
        while self._pending:
            op, plan, settlement = self._pending[0]
            try:
                await self._call(op, plan, settlement, None)
            except STORE_ERRORS as exc:
                self._failed(exc)
                return
            self._pending.popleft()
            self.stats["replayed"] += 1

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
            "pending_settlements": len(self._pending),
            **self.stats,
        }

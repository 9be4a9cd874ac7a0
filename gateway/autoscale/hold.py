"""The cold-start hold: a request for a pool with nothing serving waits while a replica starts or wakes.

It waits in flow control's waiting room (`gateway/flow/queue.py`, one room per pool in a queue of
its own, so its bound is the pool's own `max_held`): in flow order (priority band, then tenant
fairness), until a replica of the pool is ready (`ready()` answers; the executor's ready event and
the room's own recheck wake it), for at most the pool's `max_hold_s`. Past either bound the request
is answered 503 with `retry-after` from the expected start time, unless the model's fallback chain
takes it (trigger `cold_start`). The wait is part of its TTFT and is reported in
`x-tokenway-cold-start-ms`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final

from backends.fleet import Fleet, Pool
from gateway.errors import NoHealthyBackend
from gateway.flow.queue import FlowQueue
from gateway.flow.types import Blocked, FlowRequest, QueueRejected
from policies.flow.bands import band_rank
from policies.flow.counters import MemoryCounters

COLD_START_HEADER: Final = "x-tokenway-cold-start-ms"
_NO_BYTES_BOUND: Final = 1 << 40


class ColdStartRejected(NoHealthyBackend):
    code = "cold_start"


class ColdStart:
    def __init__(
        self,
        fleet: Fleet,
        expected_ready_in_s: Callable[[str], float | None],
        startup_s: Callable[[str], float],
        *,
        on_hold: Callable[[str], None] | None = None,
        on_wait: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.expected_ready_in_s = expected_ready_in_s
        self.startup_s = startup_s
        self.on_hold = on_hold  # a request began waiting: plan now
        self.on_wait = on_wait  # (pool, seconds held) once per held request
        self.clock = clock
        self.queue = FlowQueue(MemoryCounters(), room_size=self._room_size, now=clock)

    def _room_size(self, pool: str) -> tuple[int, int]:
        policy = self.fleet.pools[pool].config.autoscale
        return (policy.max_held if policy is not None else 0), _NO_BYTES_BOUND

    def pool_to_hold(self, model: str) -> Pool | None:
        """The autoscaled pool a request for `model` should wait for, or None when it need not wait
        (a pool of the model serves now) or cannot (no pool of the model scales)."""
        pools = self.fleet.pools_for_model(model)
        if any(p.has_ready for p in pools):
            return None
        return next((p for p in pools if p.config.autoscale is not None), None)

    def held(self, pool: str) -> int:
        return self.queue.depth(pool)

    def notify(self, pool: str) -> None:
        self.queue.notify(pool)

    async def hold(
        self, pool: Pool, *, request_id: str, tenant: str, priority: int, weight: float, cost_tokens: float
    ) -> float:
        """Wait for a ready replica of `pool`; the seconds waited. Raises `ColdStartRejected` past
        the pool's bounds (a cancelled caller leaves at once)."""
        policy = pool.config.autoscale
        assert policy is not None
        began = self.clock()
        request = FlowRequest(
            request_id, tenant, band_rank(priority), cost_tokens, weight, deadline_s=began + policy.max_hold_s
        )

        def ready() -> bool | Blocked:
            return True if pool.has_ready else Blocked.POOL

        if self.on_hold is not None:
            self.on_hold(pool.name)
        try:
            _value, lease = await self.queue.hold(pool.name, request, ready)
        except QueueRejected as exc:
            waited = self.clock() - began
            self._observe(pool.name, waited)
            raise self._rejection(pool, exc.reason, waited) from None
        lease.finished(None)
        waited = self.clock() - began
        self._observe(pool.name, waited)
        return waited

    def _observe(self, pool: str, seconds: float) -> None:
        if self.on_wait is not None:
            self.on_wait(pool, seconds)

    def _rejection(self, pool: Pool, reason: str, waited_s: float) -> ColdStartRejected:
        expected = self.expected_ready_in_s(pool.name)
        retry = max(1, math.ceil(expected if expected is not None else self.startup_s(pool.name)))
        why = "too many requests are waiting" if reason == "queue_full" else f"it did not start within {waited_s:.0f} s"
        return ColdStartRejected(
            f"No replica of '{pool.config.model}' is serving yet (pool {pool.name!r} is starting); {why}.",
            headers=[("retry-after", str(retry))],
        )

"""The SLO gate's I/O side (DESIGN.md §2 step 7): headers in, waiting, 503s out.

The decision itself is `policies.slo.decide`, a pure function; this module holds what it needs
around it in the gateway:

- `parse_slo_headers`: `x-slo-ttft-ms` / `x-slo-tpot-ms` as positive finite milliseconds, else a
  400 `invalid_request_error` naming the header (a silently ignored typo would be an SLO the
  client believes it has).
- `RunningTpotSlos`: per endpoint, the tightest TPOT SLO of the requests in flight there (updated
  at dispatch and end; O(distinct SLO values) per end). The pure decision and the latency scorer
  read its `floors` mapping, live, so a new request never slows those requests past their SLO.
- `SloQueue`: a bounded wait for capacity, head of line by priority then arrival: when a request on
  the pool ends, the first waiter re-routes and decides again, and passes the turn on if served.
- `slo_miss`: the `Rejection` of a miss (503 `server_error`/`slo_unattainable` with retry-after, as
  the error catalogue says), raised as `SloMiss` so the pipeline can release the reservation and,
  for `on_miss: fallback`, walk the model's chain with trigger `slo_unattainable`.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeVar

from gateway.errors import InvalidRequest
from policies.slo import Miss, Slo
from policies.types import Rejection

SLO_TTFT_HEADER: Final = "x-slo-ttft-ms"
SLO_TPOT_HEADER: Final = "x-slo-tpot-ms"

# record.reject_reason values (the metrics count shed, queue_full and queue_timeout as shed outcomes)
REASON_UNATTAINABLE: Final = "slo_unattainable"
REASON_SHED: Final = "shed"
REASON_QUEUED: Final = "queued"  # served after waiting in the queue (status ok)
REASON_QUEUE_FULL: Final = "queue_full"
REASON_QUEUE_TIMEOUT: Final = "queue_timeout"

_RECHECK_S: Final = 0.05
_MAX_SLO_MS: Final = 86_400_000.0  # a day: anything longer is a typo, not an objective

T = TypeVar("T")


def parse_slo_headers(headers: Mapping[str, str]) -> tuple[float | None, float | None]:
    """(ttft_ms, tpot_ms) from the request headers, None where absent; 400 when malformed."""
    return _header_ms(headers, SLO_TTFT_HEADER), _header_ms(headers, SLO_TPOT_HEADER)


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not (0 < value <= _MAX_SLO_MS):  # NaN fails too
        raise InvalidRequest(
            f"Invalid '{name}' header {raw[:40]!r}: expected a positive number of milliseconds "
            f"(at most {_MAX_SLO_MS:.0f}).",
            param=name,
        )
    return value


@dataclass(frozen=True, slots=True)
class RunningSlo:
    """One dispatched request's entry in `RunningTpotSlos` (hand it back to `end`)."""

    endpoint_id: str
    tpot_ms: float


class RunningTpotSlos:
    """Tightest TPOT SLO among the requests in flight on each endpoint (`floors`, read live)."""

    def __init__(self) -> None:
        self.floors: dict[str, float] = {}
        self._counts: dict[str, dict[float, int]] = {}

    def begin(self, endpoint_id: str, tpot_ms: float | None) -> RunningSlo | None:
        if tpot_ms is None:
            return None
        counts = self._counts.setdefault(endpoint_id, {})
        counts[tpot_ms] = counts.get(tpot_ms, 0) + 1
        floor = self.floors.get(endpoint_id)
        if floor is None or tpot_ms < floor:
            self.floors[endpoint_id] = tpot_ms
        return RunningSlo(endpoint_id, tpot_ms)

    def end(self, running: RunningSlo | None) -> None:
        if running is None:
            return
        counts = self._counts.get(running.endpoint_id)
        if not counts or running.tpot_ms not in counts:
            return
        left = counts[running.tpot_ms] - 1
        if left:
            counts[running.tpot_ms] = left
            return
        del counts[running.tpot_ms]
        if counts:
            self.floors[running.endpoint_id] = min(counts)
        else:
            del self._counts[running.endpoint_id]
            self.floors.pop(running.endpoint_id, None)


@dataclass(order=True, slots=True)
class _Waiter:
    rank: tuple[int, int]  # (-priority, arrival sequence): the order of wake-ups
    wake: asyncio.Future[None] = field(compare=False)


class SloQueue:
    """Requests waiting for an endpoint that meets their SLO, per pool, in priority order.

    Head of line: each event (a request on the pool ended) wakes only the first waiter (highest
    priority, then earliest); when it is served it passes the wake-up on, when it still misses the
    others keep waiting. So an event costs one prediction, not one per waiter, and nobody overtakes
    a higher-priority request. Only the head also rechecks every `recheck_s` (predictions move with
    time and scraped load too); the others wait for an event or their own deadline.
    """

    def __init__(self, recheck_s: float = _RECHECK_S) -> None:
        self.recheck_s = recheck_s
        self._waiters: dict[str, list[_Waiter]] = {}  # sorted by rank
        self._queued: dict[str, int] = {}  # SLO class -> requests waiting
        self._sequence = itertools.count()

    def queued(self, slo_class: str) -> int:
        return self._queued.get(slo_class, 0)

    def notify(self, pool: str) -> None:
        """Capacity may have freed on `pool`: wake its first waiter."""
        waiters = self._waiters.get(pool)
        while waiters:
            waiter = waiters.pop(0)
            if not waiter.wake.done():
                waiter.wake.set_result(None)
                break
        if not waiters:
            self._waiters.pop(pool, None)

    async def wait_for(
        self,
        pool: str,
        slo: Slo,
        priority: int,
        deadline_s: float,
        attempt: Callable[[], T | None],
    ) -> T | None:
        """Call `attempt` after each wake-up until it returns a value or `deadline_s` (perf_counter)
        passes; None on timeout. The caller checks `queued(...) < slo.max_queued` first."""
        rank = (-priority, next(self._sequence))
        self._queued[slo.class_name] = self._queued.get(slo.class_name, 0) + 1
        loop = asyncio.get_running_loop()
        try:
            while True:
                remaining = deadline_s - time.perf_counter()
                if remaining <= 0:
                    self.notify(pool)  # leaving the head: the next one takes over the rechecks
                    return None
                waiter = _Waiter(rank, loop.create_future())
                waiters = self._waiters.setdefault(pool, [])
                bisect.insort(waiters, waiter)
                timeout_s = min(remaining, self.recheck_s) if waiters[0] is waiter else remaining
                try:
                    with contextlib.suppress(TimeoutError):  # a timeout is a recheck, like a wake-up
                        await asyncio.wait_for(asyncio.shield(waiter.wake), timeout_s)
                finally:  # woken, timed out or cancelled: no longer waiting on this pool
                    self._forget(pool, waiter)
                found = attempt()
                if found is not None:
                    self.notify(pool)  # capacity may be left for the next one
                    return found
        finally:
            self._queued[slo.class_name] -= 1

    def _forget(self, pool: str, waiter: _Waiter) -> None:
        waiters = self._waiters.get(pool)
        if waiters and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[pool]


class SloMiss(Exception):
    """No endpoint meets the request's SLO and the policy says not to proceed: reject with
    `rejection`, or first try the model's fallback chain when `fallback`."""

    def __init__(self, rejection: Rejection, fallback: bool = False) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection
        self.fallback = fallback


def slo_miss(miss: Miss, slo: Slo, model: str, reason: str, *, waited_ms: float | None = None) -> SloMiss:
    """The 503 of a miss (`reason` is the record's reject_reason), with an honest retry-after."""
    retry_s = miss.retry_after_s()
    targets = ", ".join(
        f"{name} <= {value:g} ms" for name, value in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms)) if value
    )
    closest = miss.closest
    over = []
    if closest.ttft_excess_ms > 0:
        over.append(f"TTFT {closest.ttft_excess_ms:.0f} ms")
    if closest.tpot_excess_ms > 0:
        over.append(f"TPOT {closest.tpot_excess_ms:.1f} ms")
    parts = [f"{closest.probability:.0%} likely to meet it"] if slo.compare == "probability" else []
    if over:
        parts.append(f"{' and '.join(over)} over")
    detail = f" (closest endpoint: {'; '.join(parts)})" if parts else ""
    prefix = {
        REASON_SHED: "Shed: sheddable traffic is dropped first. ",
        REASON_QUEUE_FULL: "The SLO queue is full. ",
        REASON_QUEUE_TIMEOUT: f"Waited {waited_ms or 0:.0f} ms in the SLO queue. ",
    }.get(reason, "")
    message = (
        f"{prefix}No endpoint of '{model}' is predicted to meet the latency SLO ({targets}){detail}. "
        f"Retry in {retry_s} s."
    )
    rejection = Rejection(
        status=503,
        message=message,
        type="server_error",
        code="slo_unattainable",
        headers=(("retry-after", str(retry_s)), ("retry-after-ms", str(retry_s * 1000))),
        reason=reason,
    )
    return SloMiss(rejection, fallback=miss.action == "fallback")


@dataclass(slots=True)
class SloGate:
    """The gateway's SLO state: running TPOT SLOs per endpoint and the wait queue."""

    running: RunningTpotSlos = field(default_factory=RunningTpotSlos)
    queue: SloQueue = field(default_factory=SloQueue)

    def ended(self, pool: str, running: RunningSlo | None) -> None:
        """A request on `pool` finished (or failed): drop its TPOT SLO, wake the pool's waiters."""
        self.running.end(running)
        self.queue.notify(pool)

"""Frozen engines: first-token deadlines and stalled replicas out of routing.

An engine can stop without failing: a process stopped (`SIGSTOP`, a debugger, a swapped-out host), a
hung GPU or collective. It still accepts connections (the kernel's backlog), so nothing errors, and
without a deadline every request routed to it waits for the read timeout while its peers idle.

Two defences, both on what the gateway relays itself:

- **First-token deadline** (per request, `server.first_token_deadline`). A stream that has shown its
  client nothing when the deadline passes is cut on its replica (the engine sees the disconnect and
  aborts) and sent to another, as a failure before the first byte is: the attempt is not charged, the
  request keeps one reservation and leaves one record. The deadline is `factor` x the predictor's
  TTFT p90 for the chosen replica (`default_s` without one), clamped to [`min_s`, `max_s`], and armed
  only while another replica may take the request: the last try waits as long as the engine takes. A
  non-streamed answer shows nothing until it is whole, so it has no first-token deadline.
- **Stalled replica** (per endpoint, `server.stall_after_s`). A replica with requests in flight
  for that long, none of which received a byte for that long (no token, no answer, no head), is
  stalled when one of them is a stream (a live engine sends tokens) or when its metrics stopped
  answering too (only non-streamed work in flight: a long generation shows no byte either, a live
  engine still answers `/metrics`). So is a replica that misses `misses_to_stall` first-token
  deadlines in a row with no sign of life in between (a busy replica relays tokens for others between
  misses). A stalled replica is ejected (backends/health.py: capped like every ejection, it returns
  through the half-open health probe) and every call on it is cut: a request that showed its client
  nothing moves to another replica; a stream that did continues there when it can
  (gateway/upstream/migrate.py), else ends with an error event instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from backends.config import EjectionSettings
from backends.fleet import Fleet
from backends.health import eject_capped
from backends.types import Endpoint, EndpointState
from gateway.app.settings import FirstTokenDeadline
from gateway.upstream.client import CallWatch
from predictor.types import Prediction

log = logging.getLogger("tokenway.stalls")

DEADLINE = "first-token deadline"
STALLED = "replica stalled"


class StallWatch:
    """The calls in flight per endpoint, their deadlines, and the stall verdicts over them."""

    def __init__(
        self,
        fleet: Fleet,
        deadline: FirstTokenDeadline,
        stall_after_s: float,
        ejection: EjectionSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.deadline = deadline
        self.stall_after_s = stall_after_s
        self.ejection = ejection
        self.clock = clock
        self._calls: dict[str, tuple[Endpoint, set[CallWatch]]] = {}
        self._misses: dict[str, tuple[int, float]] = {}  # endpoint id -> (misses in a row, first one's time)
        self.stalls = 0  # stall verdicts so far (/admin, tests)

    # -- the walk's side
    def begin(self, endpoint: Endpoint, *, stream: bool) -> CallWatch:
        watch = CallWatch(endpoint.id, stream=stream, now_s=self.clock())
        entry = self._calls.get(endpoint.id)
        if entry is None or entry[0] is not endpoint:
            entry = self._calls[endpoint.id] = (endpoint, set())
        entry[1].add(watch)
        return watch

    def end(self, watch: CallWatch) -> None:
        watch.disarm()
        entry = self._calls.get(watch.endpoint_id)
        if entry is not None:
            entry[1].discard(watch)

    def deadline_s(self, prediction: Prediction | None) -> float:
        """The first-token deadline for a request with this prediction of its replica."""
        d = self.deadline
        base = d.default_s if prediction is None else d.factor * max(prediction.ttft_p90_ms, 0.0) / 1000.0
        return min(max(base, d.min_s), d.max_s)

    def arm(self, watch: CallWatch, prediction: Prediction | None) -> None:
        if self.deadline.enabled:
            watch.arm(self.deadline_s(prediction), DEADLINE)

    def missed_first_token(self, endpoint: Endpoint) -> None:
        """A call on `endpoint` was cut by its first-token deadline."""
        now = self.clock()
        count, first = self._misses.get(endpoint.id, (0, now))
        if count and self._last_life(endpoint) > first:
            count, first = 0, now  # it relayed something since: busy, not frozen
        count += 1
        self._misses[endpoint.id] = (count, first if count > 1 else now)
        if count >= self.deadline.misses_to_stall:
            self._stalled(endpoint, now, f"{count} first-token deadlines missed with no output between them")

    # -- the background side
    def check(self) -> None:
        """One pass over the endpoints with calls in flight: stall verdicts."""
        now = self.clock()
        after = self.stall_after_s
        for endpoint, all_calls in list(self._calls.values()):
            calls = [c for c in all_calls if not c.reason]  # those cut already are ending (or continue elsewhere)
            if not calls:
                continue
            if now - min(c.started_s for c in calls) < after or now - self._last_life(endpoint) < after:
                continue
            scraped = endpoint.stats.scraped_at_s
            metrics_silent = scraped > 0.0 and now - scraped >= after
            if any(c.stream for c in calls) or metrics_silent:
                self._stalled(endpoint, now, f"no byte from it for {after:g}s with {len(calls)} requests in flight")

    async def run(self) -> None:
        """`check` until cancelled, a few times per `stall_after_s`."""
        tick_s = min(0.5, self.stall_after_s / 4)
        while True:
            await asyncio.sleep(tick_s)
            try:
                self.check()
            except Exception:  # a bug here must not end the watch
                log.exception("stall check failed")

    # -- verdicts
    def _last_life(self, endpoint: Endpoint) -> float:
        """Monotonic time the endpoint last showed life on the request path: an answer, a relayed token,
        a byte on any of its calls in flight."""
        last = max(endpoint.answered_at_s, endpoint.inflight.last_token_s)
        entry = self._calls.get(endpoint.id)
        if entry is not None:
            for call in entry[1]:
                last = max(last, call.last_byte_s)
        return last

    def _stalled(self, endpoint: Endpoint, now: float, why: str) -> None:
        self.stalls += 1
        self._misses.pop(endpoint.id, None)
        if endpoint.state is EndpointState.READY:
            eject_capped(endpoint, self.fleet.pools.get(endpoint.pool), now, self.ejection, f"stalled: {why}")
        entry = self._calls.get(endpoint.id)
        calls = [c for c in entry[1] if not c.reason] if entry is not None else []
        log.warning("endpoint %s stalled (%s): cutting %d calls in flight", endpoint.id, why, len(calls))
        for call in calls:
            call.cut(STALLED)


@contextlib.asynccontextmanager
async def watching(watch: StallWatch) -> AsyncIterator[StallWatch]:
    """Run `watch.run` for the body's duration."""
    task = asyncio.create_task(watch.run(), name="stall-watch")
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""The simulated clock of one engine: step durations in, real sleeps out, host latency left out.

Simulated time advances only by computed step durations while the engine is busy; the engine sleeps
so that simulated time tracks real time x `time_scale`. When the host falls behind (a loaded CPU, many
engines in one process), the clock re-anchors instead of catching up, so simulated latencies never
include host delays.

While idle, simulated time follows the wall clock, but only to stamp arrivals: the gaps between
clients' requests are real (scaled). The next step starts at the latest of the last step's end and
the arrival (or KV-transfer landing) that woke the engine, never at the moment the event loop got
round to it, so wake-up latency is not simulated time either. At a 10x scale, 1 ms of host latency
would otherwise be 10 ms of fake queueing.

Arrivals during a step map into that step's simulated interval (never later than its end), which is
what makes a request arriving mid-step wait for the next step, as on a real engine.
"""

from __future__ import annotations

import asyncio
import time

# Real seconds the engine may fall behind its schedule before the clock forgives the lag.
MAX_LAG_S = 0.05
# Shorter waits are not slept (timers have ~1 ms granularity): the step ends at once.
MIN_SLEEP_S = 0.0005


class SimClock:
    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.scale = time_scale
        self._sim_anchor = 0.0
        self._real_anchor = time.monotonic()
        self._step_start = 0.0
        self._step_end: float | None = None  # None while idle
        self._last_end = 0.0

    @property
    def idle(self) -> bool:
        return self._step_end is None

    def now(self) -> float:
        """Simulated now: during a step, clamped to the step's interval; idle, the scaled wall clock."""
        mapped = self._sim_anchor + (time.monotonic() - self._real_anchor) * self.scale
        if self._step_end is None:
            return max(mapped, self._last_end)
        return min(max(mapped, self._step_start), self._step_end)

    def next_start(self) -> float:
        """Earliest start of the next step: the last step's end (busy or idle)."""
        return self._last_end

    def real_delay(self, sim_s: float) -> float:
        """Real seconds from now until simulated time `sim_s` (idle mapping; >= 0)."""
        return max(0.0, (sim_s - self.now()) / self.scale)

    def begin_step(self, duration_s: float, start_s: float | None = None) -> tuple[float, float]:
        """Start a step of `duration_s` simulated seconds at `start_s` (default: the last step's end,
        or now when idle); returns its (start, end)."""
        if self._step_end is None:
            start = self.now() if start_s is None else max(start_s, self._last_end)
            self._sim_anchor, self._real_anchor = start, time.monotonic()
        else:
            start = self._step_end if start_s is None else max(start_s, self._step_end)
            lag = time.monotonic() - self._real_target(start)
            if lag > MAX_LAG_S:
                self._sim_anchor, self._real_anchor = start, time.monotonic()
        self._step_start, self._step_end = start, start + duration_s
        self._last_end = start + duration_s
        return start, start + duration_s

    def step_delay(self) -> float:
        """Real seconds until the current step's end is due (<= 0: overdue)."""
        assert self._step_end is not None
        return self._real_target(self._step_end) - time.monotonic()

    async def sleep_step(self) -> None:
        """Sleep (really) until the current step's end is due."""
        delay = self.step_delay()
        # Timer granularity is ~1 ms: sleep only what matters; tiny steps just yield.
        await asyncio.sleep(delay if delay > MIN_SLEEP_S else 0)

    def go_idle(self) -> None:
        """No more work: from here simulated time follows the wall clock from the last step's end."""
        if self._step_end is None:
            return
        self._sim_anchor, self._real_anchor = self._step_end, time.monotonic()
        self._step_end = None

    def _real_target(self, sim_s: float) -> float:
        return self._real_anchor + (sim_s - self._sim_anchor) / self.scale

"""What the planner learns from what it measures: a short forecast of each token rate, and how long a
replica takes to start or wake.

A short forecast of a token rate: exponential smoothing with a trend (Holt's linear method).

The planner must start replicas a start-up time before the load needs them, so it looks ahead by
that time on the rate's level and trend instead of reacting to the last window alone:

    level_t = a·rate_t + (1 - a)·(level + trend·dt)
    trend_t = b·(level_t - level) / dt + (1 - b)·trend
    forecast(h) = max(0, level_t + trend_t·h)

A smoothed level trails a step: after a 5x burst begins it reads about 3x, and the planner asks
for its replicas a pass later than a planner that counts the engines' busy slots. So a window whose
arrivals are improbably many for the forecast (`stepped_up`: more than `z` Poisson deviations above
the expected count) is a step, not noise: the level takes that window's rate at once (`update(...,
step=True)`) and the trend folds in the rise as usual. A window that holds the step's start reads
under the new rate (part of it came before): the caller passes the rate of the window's second half
(gateway/autoscale/loop.py), which takes a step only when the replicas running cannot absorb it. Falls
stay smoothed: a scale-down waits for the measured level anyway.

A pure value: `update` returns the next forecast; the caller keeps it.

Start-up and wake-up times are learnt per pool from the replicas the executor launched and woke
(`LeadTimes`, handed to `backends.autoscale.executor.Executor`, which times every start and wake).
The planner looks ahead by this lead time and the cold-start hold quotes it in `retry-after`: a
replica asked for now serves after about one start-up. The learnt value is the median of the last
few measurements (one slow launch, a first compile, does not move it much); before any, the pool's
`autoscale.startup_s` or a default.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

DEFAULT_STARTUP_S = 30.0
DEFAULT_WAKE_S = 5.0
_KEPT = 5


@dataclass(frozen=True, slots=True)
class Forecast:
    level: float = 0.0  # tokens/s now (smoothed)
    trend: float = 0.0  # tokens/s per second
    at_s: float = 0.0  # when it was last updated (monotonic); 0 = never

    def ahead(self, horizon_s: float) -> float:
        """The rate expected `horizon_s` from `at_s` (never negative)."""
        return max(0.0, self.level + self.trend * max(horizon_s, 0.0))

    def update(self, rate: float, now_s: float, alpha: float, beta: float, *, step: bool = False) -> Forecast:
        """Fold in the rate measured over the interval that ends at `now_s`; with `step`, a rate
        above the prediction becomes the level at once."""
        if self.at_s == 0.0:
            return Forecast(rate, 0.0, now_s)
        dt = now_s - self.at_s
        if dt <= 0:
            return self
        predicted = self.level + self.trend * dt
        level = rate if step and rate > predicted else alpha * rate + (1 - alpha) * predicted
        trend = beta * (level - self.level) / dt + (1 - beta) * self.trend
        return Forecast(max(level, 0.0), trend, now_s)


def stepped_up(count: float, expected: float, z: float) -> bool:
    """Whether `count` arrivals in a window are a step up from `expected` (their forecast): more than
    `z` standard deviations of a Poisson count above it (z <= 0: never)."""
    return z > 0 and count > expected + z * math.sqrt(max(expected, 1.0))


class LeadTimes:
    """Measured start-up and wake-up times per pool; their medians are the planner's lead."""

    def __init__(self) -> None:
        self._starts: dict[str, deque[float]] = {}
        self._wakes: dict[str, deque[float]] = {}
        self._guess: dict[str, float] = {}

    def guess(self, pool: str, startup_s: float) -> None:
        """The start-up time to assume before one is measured."""
        self._guess[pool] = startup_s

    def observe_start(self, pool: str, seconds: float) -> None:
        self._starts.setdefault(pool, deque(maxlen=_KEPT)).append(seconds)

    def observe_wake(self, pool: str, seconds: float) -> None:
        self._wakes.setdefault(pool, deque(maxlen=_KEPT)).append(seconds)

    def startup_s(self, pool: str) -> float:
        found = self._starts.get(pool)
        return statistics.median(found) if found else self._guess.get(pool, DEFAULT_STARTUP_S)

    def wake_s(self, pool: str) -> float:
        found = self._wakes.get(pool)
        return statistics.median(found) if found else min(DEFAULT_WAKE_S, self.startup_s(pool))

    def measured(self, pool: str) -> dict[str, list[float]]:
        return {
            "starts_s": [round(x, 3) for x in self._starts.get(pool, ())],
            "wakes_s": [round(x, 3) for x in self._wakes.get(pool, ())],
        }

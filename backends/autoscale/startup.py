"""Start-up and wake-up times learnt per pool from the replicas the executor launched and woke.

The planner looks ahead by this lead time and the cold-start hold quotes it in `retry-after`: a
replica asked for now serves after about one start-up. The learnt value is the median of the last
few measurements (one slow launch, a first compile, does not move it much); before any, the pool's
`autoscale.startup_s` or a default.
"""

from __future__ import annotations

import statistics
from collections import deque

DEFAULT_STARTUP_S = 30.0
DEFAULT_WAKE_S = 5.0
_KEPT = 5


class LeadTimes:
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

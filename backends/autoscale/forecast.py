"""A short forecast of a token rate: exponential smoothing with a trend (Holt's linear method).

The planner must start replicas a start-up time before the load needs them, so it looks ahead by
that time on the rate's level and trend instead of reacting to the last window alone:

    level_t = a·rate_t + (1 - a)·(level + trend·dt)
    trend_t = b·(level_t - level) / dt + (1 - b)·trend
    forecast(h) = max(0, level_t + trend_t·h)

A pure value: `update` returns the next forecast; the caller keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Forecast:
    level: float = 0.0  # tokens/s now (smoothed)
    trend: float = 0.0  # tokens/s per second
    at_s: float = 0.0  # when it was last updated (monotonic); 0 = never

    def ahead(self, horizon_s: float) -> float:
        """The rate expected `horizon_s` from `at_s` (never negative)."""
        return max(0.0, self.level + self.trend * max(horizon_s, 0.0))

    def update(self, rate: float, now_s: float, alpha: float, beta: float) -> Forecast:
        """Fold in the rate measured over the interval that ends at `now_s`."""
        if self.at_s == 0.0:
            return Forecast(rate, 0.0, now_s)
        dt = now_s - self.at_s
        if dt <= 0:
            return self
        predicted = self.level + self.trend * dt
        level = alpha * rate + (1 - alpha) * predicted
        trend = beta * (level - self.level) / dt + (1 - beta) * self.trend
        return Forecast(max(level, 0.0), trend, now_s)

"""A circuit breaker for the shared store: after `failure_threshold` consecutive failures it opens and
every call skips Redis (no connect attempt, no timeout) for `open_s`; then one probe is let through,
and its success closes the breaker. Without it a dead Redis would cost each request a timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
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

"""The circuit breaker's states: closed -> open after N failures -> one probe -> closed or open again."""

from __future__ import annotations

from policies.limits.failover import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_lets_one_probe_through() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=2, open_s=5.0, clock=clock)
    breaker.failure()
    assert breaker.allow()
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    assert breaker.retry_after_s() == 5.0
    clock.now = 5.0
    assert breaker.allow()
    assert breaker.state == "half_open"  # type: ignore[comparison-overlap]
    assert not breaker.allow()  # only the one probe
    assert breaker.success() is True and breaker.state == "closed"
    assert breaker.success() is False


def test_a_failed_probe_reopens() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, open_s=1.0, clock=clock)
    breaker.failure()
    clock.now = 1.0
    assert breaker.allow()
    breaker.failure()
    assert breaker.state == "open" and breaker.trips == 2 and not breaker.allow()


def test_a_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(failure_threshold=2)
    breaker.failure()
    breaker.success()
    breaker.failure()
    assert breaker.state == "closed"

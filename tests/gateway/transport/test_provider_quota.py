"""A hosted provider's announced limits block its pool until the reset, bounded."""

from __future__ import annotations

from backends.hosted.base import RateLimitState
from gateway.transport.provider_quota import DEFAULT_BLOCK_S, MAX_BLOCK_S, ProviderQuotas


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nothing_remaining_blocks_until_the_reset_and_then_not() -> None:
    clock = Clock()
    quotas = ProviderQuotas(clock)
    quotas.observe("claude", RateLimitState(requests_remaining=3, reset_s=20.0))
    assert quotas.blocked_s("claude") == 0.0
    quotas.observe("claude", RateLimitState(requests_remaining=5, tokens_remaining=0, reset_s=20.0))
    assert quotas.blocked_s("claude") == 20.0
    clock.now += 20.0
    assert quotas.blocked_s("claude") == 0.0
    assert quotas.blocked_s("other") == 0.0


def test_a_throttle_blocks_for_retry_after_else_the_last_reset_else_a_second_and_never_past_the_cap() -> None:
    clock = Clock()
    quotas = ProviderQuotas(clock)
    quotas.throttled("a", 7.0)
    assert quotas.blocked_s("a") == 7.0
    quotas.observe("b", RateLimitState(requests_remaining=1, reset_s=12.0))
    quotas.throttled("b", None)
    assert quotas.blocked_s("b") == 12.0
    quotas.throttled("c", None)
    assert quotas.blocked_s("c") == DEFAULT_BLOCK_S
    quotas.throttled("d", 10_000.0)  # a wrong or hostile header cannot park a pool
    assert quotas.blocked_s("d") == MAX_BLOCK_S
    assert quotas.status()["d"] == {"blocked_s": MAX_BLOCK_S, "blocks": 1}

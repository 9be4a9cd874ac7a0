"""A hosted provider's own rate limits, learnt from its answers: a pool whose provider said "no more
until T" is not sent to before T.

Providers announce their limits on every answer (`anthropic-ratelimit-*-remaining` / `-reset`,
Azure's and OpenAI's `x-ratelimit-*`, read by each codec's `rate_limits`) and refuse with 429 or 529
and `retry-after` once over. Sending into a known refusal costs a round trip to the provider, counts
against the account on some providers, and delays the fallback the gateway would take anyway. So:

- after a successful answer, a limit with nothing `remaining` blocks the endpoint until its reset;
- a throttling refusal (429, 529, Bedrock's ThrottlingException) blocks it for `retry-after`, else for
  the reset the last answer named, else for `DEFAULT_BLOCK_S`;
- a block never lasts longer than `MAX_BLOCK_S` (a wrong or hostile header cannot park a pool).

`ProviderQuotaCheck` is the gate's check (gateway/flow/gate.py): a route to a blocked pool is
avoided, so the room routes the request to the model's other pools (owned replicas, another
provider); with none left the request is refused as `rate_limited`, which walks the model's fallback
chain or answers 429 with `retry-after` until the provider's reset. State is per gateway process
and per endpoint (an endpoint is one provider key or region; a pool may list several, and a request
avoids only the exhausted ones): one small entry per hosted endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from backends.hosted.base import RateLimitState
from gateway.errors import Rejected
from gateway.flow.gate import GO, Avoid, Check, Refuse, Turn, Verdict
from gateway.request import Detour, Routed
from policies.limits.admission import retry_headers
from policies.types import Rejection

DEFAULT_BLOCK_S = 1.0
MAX_BLOCK_S = 60.0


@dataclass(slots=True)
class _Quota:
    blocked_until_s: float = 0.0
    reset_s: float | None = None  # the last answer's reset of its tightest limit
    blocks: int = 0


class ProviderQuotas:
    """Per hosted endpoint (one key or region of a provider): until when it is known to refuse."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pools: dict[str, _Quota] = {}

    def observe(self, pool: str, state: RateLimitState) -> None:
        """A successful answer's announced limits."""
        quota = self._pools.setdefault(pool, _Quota())
        quota.reset_s = state.reset_s
        exhausted = any(
            remaining is not None and remaining <= 0
            for remaining in (
                state.requests_remaining,
                state.tokens_remaining,
                state.input_tokens_remaining,
                state.output_tokens_remaining,
            )
        )
        if exhausted:
            self._block(quota, state.reset_s)

    def throttled(self, pool: str, retry_after_s: float | None) -> None:
        """The provider refused as over its limits."""
        quota = self._pools.setdefault(pool, _Quota())
        self._block(quota, retry_after_s if retry_after_s is not None else quota.reset_s)

    def _block(self, quota: _Quota, for_s: float | None) -> None:
        wait_s = DEFAULT_BLOCK_S if for_s is None or for_s <= 0 else min(for_s, MAX_BLOCK_S)
        quota.blocked_until_s = max(quota.blocked_until_s, self._clock() + wait_s)
        quota.blocks += 1

    def blocked_s(self, pool: str) -> float:
        """Seconds until `pool`'s provider may be sent to again (0: now)."""
        quota = self._pools.get(pool)
        if quota is None:
            return 0.0
        return max(0.0, quota.blocked_until_s - self._clock())

    def status(self) -> dict[str, dict[str, float | int]]:
        """Per endpoint: seconds still blocked and blocks so far (`/admin/pools`)."""
        return {
            pool: {"blocked_s": round(self.blocked_s(pool), 3), "blocks": q.blocks} for pool, q in self._pools.items()
        }


class ProviderQuotaCheck(Check):
    """The gate's check: not on a pool whose provider is known to refuse until a reset."""

    def __init__(self, quotas: ProviderQuotas, hosted_pools: Mapping[str, object]) -> None:
        self.quotas = quotas
        self.hosted = frozenset(hosted_pools)

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        endpoint = routed.endpoint
        if endpoint.pool not in self.hosted:
            return GO
        wait_s = self.quotas.blocked_s(endpoint.id)
        if wait_s <= 0.0:
            return GO
        message = (
            f"The provider of pool '{endpoint.pool}' for {turn.ctx.model} is over its rate limits on every key; "
            f"it accepts requests again in {wait_s:.1f} s."
        )
        rejection = Rejection(
            429, message, "requests", code="rate_limit_exceeded", headers=tuple(retry_headers(wait_s)),
            reason="rate_limited",
        )  # fmt: skip
        return Avoid((endpoint.id,), Refuse(Detour("rate_limited", Rejected(rejection))))

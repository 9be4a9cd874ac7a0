"""`prefix-cache` scorer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheScorer:
    """Share of the prompt already in the endpoint's KV cache.

        score = cached_tokens / prompt_tokens        (0 for an empty prompt)

    Range [0, 1]: 1 means the whole prompt (but the last token, which is always computed) is cached.
    Absolute, not relative to the best candidate: a 5 % hit must not look like a full one.
    Reads: `Candidate.cached_tokens` (prefix index), `RouteContext.prompt_tokens`.
    """

    consumes = ("prefix-index",)

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        if ctx.prompt_tokens <= 0:
            return [0.0] * len(candidates)
        return [min(c.cached_tokens / ctx.prompt_tokens, 1.0) for c in candidates]

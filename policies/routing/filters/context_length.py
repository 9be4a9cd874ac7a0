"""`context-length` filter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextLengthFilter:
    """Drops endpoints whose context window cannot hold the prompt plus the requested output.

        keep iff max_model_len is unknown or prompt_tokens + max_tokens <= max_model_len

    A pool of mixed windows (e.g. 32k and 128k replicas) sends long prompts only where they fit,
    instead of to an engine that answers 400. Reads: `Endpoint.max_model_len`, `RequestFacts.max_tokens`.
    """

    consumes = ("endpoint.max_model_len",)

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        needed = ctx.prompt_tokens + (ctx.facts.max_tokens or 0)
        return [c for c in candidates if c.endpoint.max_model_len is None or needed <= c.endpoint.max_model_len]

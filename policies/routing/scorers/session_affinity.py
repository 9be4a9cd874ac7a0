"""`session-affinity` scorer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionAffinityScorer:
    """Keeps a session (header or the OpenAI `user` field) on the endpoint that served it last.

        score = 1 if endpoint is the session's pinned endpoint else 0

    Range {0, 1}. The pin is made at dispatch, so a session follows its endpoint when load or a
    failure moved it. Reads: `RouteContext.session_endpoint_id` (the router's session table).
    """

    consumes = ("session",)

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        pinned = ctx.session_endpoint_id
        return [1.0 if pinned is not None and c.id == pinned else 0.0 for c in candidates]

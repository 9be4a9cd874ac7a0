"""`max-score` picker."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext

_TIE = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class MaxScorePicker:
    """The highest total; ties (within 1e-9) broken uniformly at random.

    Deterministic affinity, so it hot-spots under identical traffic unless a load gate or load
    scorer pushes back; prefer `near-best-random` for production.
    """

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int:
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if t >= best - _TIE]
        return tied[0] if len(tied) == 1 else rng.choice(tied)

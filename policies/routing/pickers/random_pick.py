"""`random` picker."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomPicker:
    """Uniformly at random, ignoring the scores (a baseline, or behind filters that did the work)."""

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int:
        return rng.randrange(len(candidates))

"""`weighted-random` picker."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightedRandomPicker:
    """Chance proportional to the total score (A-Res: the largest key U^(1/total) wins).

    Every candidate with a positive total can be chosen; all-zero totals choose uniformly. Spreads
    more than `near-best-random`, at the price of sometimes picking a clearly worse endpoint.
    """

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int:
        if max(totals) <= 0.0:
            return rng.randrange(len(totals))
        best_i, best_key = 0, -1.0
        for i, t in enumerate(totals):
            if t <= 0.0:
                continue
            key = rng.random() ** (1.0 / t)
            if key > best_key:
                best_i, best_key = i, key
        return best_i

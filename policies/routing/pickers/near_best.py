"""`near-best-random` picker."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from policies.routing.types import Candidate, RouteContext


@dataclass(frozen=True, slots=True, kw_only=True)
class NearBestRandomPicker:
    """Uniformly at random among the candidates whose total is within `tolerance` of the best.

        near = {i : total_i >= max(total) - tolerance}      (totals are normalised to [0, 1])

    Differences smaller than the scorers' noise (a scrape 250 ms old, an estimate of cached tokens)
    should not decide; spreading among equals keeps identical prompts arriving together from piling
    onto one replica, while a clearly better candidate (a long prefix hit) still wins alone.
    """

    tolerance: float = 0.03

    def __post_init__(self) -> None:
        if not 0.0 <= self.tolerance <= 1.0:
            raise ValueError("tolerance must be in [0, 1]")

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int:
        floor = max(totals) - self.tolerance - 1e-9
        near = [i for i, t in enumerate(totals) if t >= floor]
        return near[0] if len(near) == 1 else rng.choice(near)

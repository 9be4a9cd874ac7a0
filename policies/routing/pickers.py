"""Pickers: each chooses one candidate from the weighed totals (normalised to [0, 1]) by the name
`registry.py` gives it."""

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


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomPicker:
    """Uniformly at random, ignoring the scores (a baseline, or behind filters that did the work)."""

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int:
        return rng.randrange(len(candidates))

import random
from collections import Counter

import pytest

from policies.routing.components import WeightedRandomPicker
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("totals", "never"),
    [
        pytest.param([0.8, 0.0, 0.4], {1}, id="zero-score-never-chosen"),
        pytest.param([0.0, 0.0], set(), id="all-zero-uniform"),
    ],
)
def test_weighted_random_support(totals: list[float], never: set[int]) -> None:
    cands = [candidate(endpoint(f"e{i}")) for i in range(len(totals))]
    rng = random.Random(5)
    picks = Counter(WeightedRandomPicker().pick(context(), cands, totals, rng) for _ in range(400))
    assert not (set(picks) & never)
    assert len(picks) == len(totals) - len(never)


def test_weighted_random_prefers_higher_scores() -> None:
    cands = [candidate(endpoint(f"e{i}")) for i in range(2)]
    rng = random.Random(7)
    picks = Counter(WeightedRandomPicker().pick(context(), cands, [0.9, 0.1], rng) for _ in range(1000))
    assert picks[0] > 4 * picks[1]

import random
from collections import Counter

import pytest

from policies.routing.components import MaxScorePicker
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("totals", "expected"),
    [
        pytest.param([0.1, 0.9, 0.5], 1, id="highest"),
        pytest.param([0.0], 0, id="single"),
        pytest.param([0.5, 0.5 + 1e-12, 0.2], {0, 1}, id="tie-within-epsilon"),
    ],
)
def test_max_score_picks(totals: list[float], expected: int | set[int]) -> None:
    cands = [candidate(endpoint(f"e{i}")) for i in range(len(totals))]
    picked = MaxScorePicker().pick(context(), cands, totals, random.Random(0))
    assert picked in expected if isinstance(expected, set) else picked == expected


def test_max_score_breaks_ties_randomly() -> None:
    cands = [candidate(endpoint(f"e{i}")) for i in range(3)]
    rng = random.Random(1)
    picks = Counter(MaxScorePicker().pick(context(), cands, [0.7, 0.7, 0.7], rng) for _ in range(300))
    assert set(picks) == {0, 1, 2}

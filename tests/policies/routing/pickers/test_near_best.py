import random
from collections import Counter

import pytest

from policies.routing.components import NearBestRandomPicker
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("totals", "tolerance", "allowed"),
    [
        pytest.param([0.90, 0.89, 0.50], 0.03, {0, 1}, id="near-best-spread"),
        pytest.param([0.90, 0.80, 0.50], 0.03, {0}, id="clear-winner"),
        pytest.param([0.90, 0.80, 0.50], 0.0, {0}, id="zero-tolerance"),
        pytest.param([0.5, 0.5, 0.5], 0.03, {0, 1, 2}, id="all-equal"),
    ],
)
def test_near_best_random(totals: list[float], tolerance: float, allowed: set[int]) -> None:
    cands = [candidate(endpoint(f"e{i}")) for i in range(len(totals))]
    picker = NearBestRandomPicker(tolerance=tolerance)
    rng = random.Random(3)
    picks = Counter(picker.pick(context(), cands, totals, rng) for _ in range(200))
    assert set(picks) == allowed


def test_near_best_rejects_bad_tolerance() -> None:
    with pytest.raises(ValueError):
        NearBestRandomPicker(tolerance=2.0)

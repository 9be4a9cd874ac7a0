import random
from collections import Counter

from policies.routing.components import RandomPicker
from tests.policies.routing.factories import candidate, context, endpoint


def test_random_ignores_scores() -> None:
    cands = [candidate(endpoint(f"e{i}")) for i in range(3)]
    rng = random.Random(11)
    picks = Counter(RandomPicker().pick(context(), cands, [1.0, 0.0, 0.0], rng) for _ in range(300))
    assert set(picks) == {0, 1, 2}

import pytest

from policies.routing.components import KvUsageScorer
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("usage", "saturated", "expected"),
    [
        pytest.param([0.0, 0.25, 1.0], [False] * 3, [1.0, 0.75, 0.0], id="one-minus-usage"),
        pytest.param([1.2, -0.1], [False, False], [0.0, 1.0], id="clamped"),
        pytest.param([0.1], [True], [0.0], id="saturated"),
    ],
)
def test_kv_usage_scores(usage: list[float], saturated: list[bool], expected: list[float]) -> None:
    cands = [
        candidate(endpoint(f"e{i}", kv_usage_ratio=u), 0, s)
        for i, (u, s) in enumerate(zip(usage, saturated, strict=True))
    ]
    assert KvUsageScorer().score(context(), cands) == pytest.approx(expected)

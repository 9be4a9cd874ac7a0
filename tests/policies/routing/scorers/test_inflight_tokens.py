import pytest

from policies.routing.components import InflightTokensScorer
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("loads", "saturated", "expected"),
    [
        pytest.param([(0, 0), (2048, 0), (0, 6144)], [False] * 3, [1.0, 0.5, 0.25], id="prefill-and-decode-count"),
        pytest.param([(100, 100), (100, 100)], [False, False], [1.0, 1.0], id="equal"),
        pytest.param([(0, 0), (10, 0)], [False, False], [1.0, 2048 / 2058], id="idle-fleet-small-difference"),
        pytest.param([(0, 0), (4096, 0)], [True, False], [0.0, 1.0], id="saturated"),
    ],
)
def test_inflight_tokens_scores(loads: list[tuple[int, int]], saturated: list[bool], expected: list[float]) -> None:
    cands = [
        candidate(endpoint(f"e{i}", prefill_tokens=p, decode_tokens=d), 0, s)
        for i, ((p, d), s) in enumerate(zip(loads, saturated, strict=True))
    ]
    assert InflightTokensScorer().score(context(), cands) == pytest.approx(expected)

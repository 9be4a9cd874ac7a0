import pytest

from policies.routing.components import WorkCostScorer
from tests.policies.routing.factories import candidate, context, endpoint

# prompt 4096 tokens; each case: (cached, prefill pending, decode tokens, requests) per endpoint
CASES = [
    pytest.param([(0, 0, 0, 0), (0, 0, 0, 0)], [1.0, 1.0], id="idle-equal"),
    pytest.param([(4000, 0, 0, 0), (0, 0, 0, 0)], [1.0, 608 / 4608], id="prefix-hit-saves-work"),
    pytest.param([(4000, 8192, 0, 0), (0, 0, 0, 0)], [4608 / 8800, 1.0], id="busy-holder-loses-to-idle"),
    pytest.param([(0, 0, 40960, 0), (0, 0, 0, 0)], [4608 / 8704, 1.0], id="decode-context-weighted"),
    pytest.param([(0, 0, 0, 8), (0, 0, 0, 0)], [4608 / 5632, 1.0], id="in-flight-requests-count"),
]


@pytest.mark.parametrize(("rows", "expected"), CASES)
def test_work_cost_scores(rows: list[tuple[int, int, int, int]], expected: list[float]) -> None:
    cands = [
        candidate(endpoint(f"e{i}", prefill_tokens=p, decode_tokens=d, requests=r), cached)
        for i, (cached, p, d, r) in enumerate(rows)
    ]
    scorer = WorkCostScorer(decode_weight=0.1, request_tokens=128, base_tokens=512)
    assert scorer.score(context(4096), cands) == pytest.approx(expected)


def test_work_cost_saturated_scores_zero_and_is_not_the_reference() -> None:
    cands = [candidate(endpoint("e0"), 4000, saturated=True), candidate(endpoint("e1"), 0)]
    assert WorkCostScorer().score(context(4096), cands) == [0.0, 1.0]


@pytest.mark.parametrize(
    "params",
    [
        pytest.param({"base_tokens": 0}, id="base-zero"),
        pytest.param({"decode_weight": -1}, id="negative-decode-weight"),
    ],
)
def test_work_cost_rejects_bad_params(params: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        WorkCostScorer(**params)

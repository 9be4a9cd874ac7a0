import pytest

from policies.routing.components import QueueDepthScorer
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("waiting", "saturated", "expected"),
    [
        pytest.param([0, 1, 3], [False] * 3, [1.0, 0.5, 0.25], id="different"),
        pytest.param([4, 4], [False, False], [1.0, 1.0], id="equal"),
        pytest.param([0, 0, 0], [False] * 3, [1.0, 1.0, 1.0], id="zero"),
        pytest.param([10, 11], [False, False], [1.0, 11 / 12], id="small-relative-difference"),
        pytest.param([0, 5], [True, False], [0.0, 1.0], id="saturated-scores-zero"),
        pytest.param([0, 5], [True, True], [0.0, 0.0], id="all-saturated"),
    ],
)
def test_queue_depth_scores(waiting: list[int], saturated: list[bool], expected: list[float]) -> None:
    cands = [
        candidate(endpoint(f"e{i}", waiting=w), 0, s) for i, (w, s) in enumerate(zip(waiting, saturated, strict=True))
    ]
    assert QueueDepthScorer().score(context(), cands) == pytest.approx(expected)


def test_queue_depth_rejects_bad_smoothing() -> None:
    with pytest.raises(ValueError):
        QueueDepthScorer(smoothing_requests=0)

import pytest

from policies.routing.components import SessionAffinityScorer
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("pinned", "expected"),
    [
        pytest.param("e1", [0.0, 1.0, 0.0], id="pinned-endpoint"),
        pytest.param(None, [0.0, 0.0, 0.0], id="no-session"),
        pytest.param("gone", [0.0, 0.0, 0.0], id="pinned-endpoint-not-a-candidate"),
    ],
)
def test_session_affinity_scores(pinned: str | None, expected: list[float]) -> None:
    cands = [candidate(endpoint(f"e{i}")) for i in range(3)]
    assert SessionAffinityScorer().score(context(session_endpoint_id=pinned), cands) == expected

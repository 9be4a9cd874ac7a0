import pytest

from policies.routing.components import LeastInflightRouter
from tests.policies.routing.factories import NOW_S, endpoint, pool, request


@pytest.mark.parametrize(
    ("requests", "allowed"),
    [
        pytest.param([3, 1, 2], {"e1"}, id="fewest-in-flight"),
        pytest.param([1, 1, 5], {"e0", "e1"}, id="tie"),
    ],
)
def test_least_inflight(requests: list[int], allowed: set[str]) -> None:
    eps = [endpoint(f"e{i}", requests=r) for i, r in enumerate(requests)]
    d = LeastInflightRouter().route(request([1]), pool(eps), NOW_S)
    assert d is not None and d.endpoint.id in allowed and d.reason == "load"


def test_ties_rotate() -> None:
    router = LeastInflightRouter()
    p = pool([endpoint("a"), endpoint("b")])
    seen = {router.route(request([1]), p, NOW_S).endpoint.id for _ in range(4)}  # type: ignore[union-attr]
    assert seen == {"a", "b"}

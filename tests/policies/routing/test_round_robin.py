from backends.types import EndpointState, Role
from policies.routing.components import RoundRobinRouter
from tests.policies.routing.factories import NOW_S, endpoint, pool, request


def test_rotates_over_ready_serving_endpoints() -> None:
    eps = [
        endpoint("a"),
        endpoint("down", state=EndpointState.UNHEALTHY),
        endpoint("b"),
        endpoint("p", role=Role.PREFILL),
    ]
    router = RoundRobinRouter()
    picks = [router.route(request([1]), pool(eps), NOW_S) for _ in range(4)]
    assert [d.endpoint.id for d in picks if d] == ["a", "b", "a", "b"]


def test_exclude_and_empty() -> None:
    router = RoundRobinRouter()
    d = router.route(request([1]), pool([endpoint("a"), endpoint("b")]), NOW_S, exclude={"a"})
    assert d is not None and (d.endpoint.id, d.reason) == ("b", "only")
    assert router.route(request([1]), pool([endpoint("a")]), NOW_S, exclude={"a"}) is None

import pytest

from policies.routing.types import RouteDecision
from tests.policies.routing.factories import endpoint


@pytest.mark.parametrize(
    ("prefill", "cached", "prefill_cached", "expected"),
    [
        pytest.param(False, 1000, 0, 3000, id="local-prefill-counts-decode-cache"),
        pytest.param(True, 1000, 2500, 1500, id="disaggregated-counts-prefill-cache"),
        pytest.param(False, 5000, 0, 0, id="never-negative"),
    ],
)
def test_uncached_prefill_tokens(prefill: bool, cached: int, prefill_cached: int, expected: int) -> None:
    d = RouteDecision(
        endpoint=endpoint("d"),
        reason="load",
        prefill_endpoint=endpoint("p") if prefill else None,
        cached_tokens_estimate=cached,
        prefill_cached_tokens_estimate=prefill_cached,
    )
    assert d.uncached_prefill_tokens(4000) == expected
    assert d.disaggregated is prefill


def test_debug_header() -> None:
    d = RouteDecision(
        endpoint=endpoint("d"),
        reason="prefix-hit",
        prefill_endpoint=endpoint("p"),
        cached_tokens_estimate=64,
        pd_reason="disaggregated",
        scores={"d": {"work-cost": 1.0, "total": 0.5}},
    )
    assert d.debug_header() == (
        "reason=prefix-hit; endpoint=d; cached=64; pd=disaggregated; prefill=p; d=[work-cost:1.000,total:0.500]"
    )

import pytest

from policies.routing.components import PrefixCacheScorer
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("prompt_tokens", "cached", "expected"),
    [
        pytest.param(1000, [0, 500, 999], [0.0, 0.5, 0.999], id="share-of-prompt"),
        pytest.param(1000, [0, 0], [0.0, 0.0], id="no-hits"),
        pytest.param(0, [0, 0], [0.0, 0.0], id="empty-prompt"),
        pytest.param(100, [200], [1.0], id="clamped"),
        pytest.param(1000, [50, 60], [0.05, 0.06], id="absolute-not-relative"),
    ],
)
def test_prefix_cache_scores(prompt_tokens: int, cached: list[int], expected: list[float]) -> None:
    cands = [candidate(endpoint(f"e{i}"), c) for i, c in enumerate(cached)]
    assert PrefixCacheScorer().score(context(prompt_tokens), cands) == pytest.approx(expected)

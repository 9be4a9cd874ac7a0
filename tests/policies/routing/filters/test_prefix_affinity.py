import pytest

from policies.routing.components import PrefixAffinityFilter
from policies.routing.config import RoutingConfig
from policies.routing.pipeline import check_consumes
from tests.policies.routing.factories import candidate, context, endpoint

# 10 tokens/s of prefill and a 1 s penalty: the release fires at a backlog gap over 10 tokens
GATE = PrefixAffinityFilter(threshold=0.8, max_ttft_penalty_s=1.0, peak_prefill_tokens_per_s=10.0)


@pytest.mark.parametrize(
    ("cached", "backlog", "kept"),
    [
        pytest.param([900, 100, 0], [5, 0, 0], ["e0"], id="sticks-to-the-warm-one"),
        pytest.param([800, 850, 0], [0, 0, 0], ["e0", "e1"], id="threshold-is-inclusive"),
        pytest.param([799, 500, 0], [0, 0, 0], ["e0", "e1", "e2"], id="none-warm-keeps-all"),
        pytest.param([900, 950], [50, 0], ["e0", "e1"], id="all-warm-keeps-all"),
        pytest.param([900, 0, 0], [10, 0, 3], ["e0"], id="gap-at-tau-still-sticky"),
        pytest.param([900, 0, 0], [11, 0, 3], ["e0", "e1", "e2"], id="gap-over-tau-releases"),
        pytest.param([900, 900, 0], [40, 2, 0], ["e0", "e1"], id="best-warm-decides"),
        pytest.param([900, 0, 0], [30, 25, 25], ["e0"], id="best-cold-busy-too"),
    ],
)
def test_prefix_affinity(cached: list[int], backlog: list[int], kept: list[str]) -> None:
    cands = [
        candidate(endpoint(f"e{i}", prefill_tokens=b), cached_tokens=c)
        for i, (c, b) in enumerate(zip(cached, backlog, strict=True))
    ]
    assert [c.id for c in GATE.filter(context(prompt_tokens=1000), cands)] == kept


def test_zero_penalty_never_releases() -> None:
    always = PrefixAffinityFilter(max_ttft_penalty_s=0.0)
    cands = [candidate(endpoint("e0", prefill_tokens=10**9), 1000), candidate(endpoint("e1"), 0)]
    assert [c.id for c in always.filter(context(prompt_tokens=1000), cands)] == ["e0"]


def test_empty_prompt_and_single_candidate_pass_through() -> None:
    one = [candidate(endpoint("e0"), 0)]
    assert GATE.filter(context(prompt_tokens=1000), one) == one
    two = [candidate(endpoint("e0"), 0), candidate(endpoint("e1"), 0)]
    assert GATE.filter(context(prompt_tokens=0), two) == two


@pytest.mark.parametrize(
    "params",
    [{"threshold": 0.0}, {"threshold": 1.5}, {"max_ttft_penalty_s": -1.0}, {"peak_prefill_tokens_per_s": 0.0}],
)
def test_rejects_bad_params(params: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PrefixAffinityFilter(**params)


def test_llmd_pipeline_config_validates_and_needs_nothing_unconfigured() -> None:
    """The replay benchmark's llm-d baseline is a plain routing: section."""
    config = RoutingConfig.model_validate(
        {
            "default": {
                "filters": [{"type": "prefix-affinity", "params": {"peak_prefill_tokens_per_s": 21702}}],
                "scorers": [{"type": "work-cost", "params": {"decode_weight": 0.0, "request_tokens": 0.0}}],
                "picker": {"type": "max-score"},
            }
        }
    )
    assert check_consumes(config, predictor=False) == []
    with pytest.raises(ValueError, match="prefix-affinity"):
        RoutingConfig.model_validate(
            {"default": {"filters": [{"type": "prefix-affinity", "params": {"threshold": 2}}]}}
        )

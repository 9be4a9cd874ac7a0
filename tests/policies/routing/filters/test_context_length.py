import pytest

from policies.routing.components import ContextLengthFilter
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "kept"),
    [
        pytest.param(1000, None, ["small", "large", "unknown"], id="fits-everywhere"),
        pytest.param(3000, 2000, ["large", "unknown"], id="output-does-not-fit-small"),
        pytest.param(4000, 96, ["small", "large", "unknown"], id="exactly-fits"),
        pytest.param(200_000, None, ["unknown"], id="only-unknown-window"),
    ],
)
def test_context_length(prompt_tokens: int, max_tokens: int | None, kept: list[str]) -> None:
    cands = [
        candidate(endpoint("small", max_model_len=4096)),
        candidate(endpoint("large", max_model_len=131_072)),
        candidate(endpoint("unknown")),
    ]
    ctx = context(prompt_tokens, max_tokens=max_tokens)
    assert [c.id for c in ContextLengthFilter().filter(ctx, cands)] == kept

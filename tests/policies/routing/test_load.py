import pytest

from policies.routing.components import work_tokens
from tests.policies.routing.factories import endpoint


@pytest.mark.parametrize(
    ("prefill", "decode", "requests", "decode_weight", "request_tokens", "expected"),
    [
        pytest.param(100, 0, 0, 0.1, 0, 100, id="prefill-counts-fully"),
        pytest.param(0, 1000, 0, 0.1, 0, 100, id="decode-weighted"),
        pytest.param(0, 0, 3, 0.1, 128, 384, id="per-request"),
    ],
)
def test_work_tokens(
    prefill: int, decode: int, requests: int, decode_weight: float, request_tokens: float, expected: float
) -> None:
    e = endpoint("a", prefill_tokens=prefill, decode_tokens=decode, requests=requests)
    assert work_tokens(e, decode_weight, request_tokens) == pytest.approx(expected)

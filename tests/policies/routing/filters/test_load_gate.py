import pytest

from policies.routing.components import LoadGateFilter
from tests.policies.routing.factories import candidate, context, endpoint


@pytest.mark.parametrize(
    ("requests", "kept"),
    [
        pytest.param([0, 8, 3], ["e0", "e1", "e2"], id="within-abs-threshold"),
        pytest.param([0, 9, 3], ["e0", "e2"], id="over-abs-and-rel"),
        pytest.param([20, 29, 25], ["e0", "e1", "e2"], id="over-abs-within-rel"),
        pytest.param([20, 31, 25], ["e0", "e2"], id="over-both-under-load"),
        pytest.param([5, 5], ["e0", "e1"], id="equal"),
        pytest.param([50], ["e0"], id="single-candidate"),
    ],
)
def test_load_gate_requests(requests: list[int], kept: list[str]) -> None:
    cands = [candidate(endpoint(f"e{i}", requests=r)) for i, r in enumerate(requests)]
    result = LoadGateFilter(metric="requests", abs_threshold=8, rel_threshold=1.5).filter(context(), cands)
    assert [c.id for c in result] == kept


@pytest.mark.parametrize(
    ("loads", "kept"),
    [
        pytest.param([(0, 0), (40_000, 0)], ["e0"], id="prefill-backlog"),
        pytest.param([(0, 0), (0, 400_000)], ["e0"], id="decode-context-weighted"),
        pytest.param([(0, 0), (20_000, 100_000)], ["e0", "e1"], id="under-threshold"),
    ],
)
def test_load_gate_tokens(loads: list[tuple[int, int]], kept: list[str]) -> None:
    cands = [candidate(endpoint(f"e{i}", prefill_tokens=p, decode_tokens=d)) for i, (p, d) in enumerate(loads)]
    gate = LoadGateFilter(metric="tokens", abs_threshold=32_768, rel_threshold=1.5, decode_weight=0.1)
    assert [c.id for c in gate.filter(context(), cands)] == kept


def test_load_gate_rejects_rel_below_one() -> None:
    with pytest.raises(ValueError):
        LoadGateFilter(rel_threshold=0.5)

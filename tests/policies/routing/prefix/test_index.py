import pytest

from backends.kv_events import RESET_GAP
from policies.routing.config import PrefixIndexAdvanced, PrefixIndexConfig
from policies.routing.prefix_index import PrefixIndex
from tests.policies.routing.factories import NOW_S, endpoint, prompt, token_ids
from tests.policies.routing.prefix.events import batch, removed, stored

PROMPT = token_ids(640)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        pytest.param("off", [0, 0], id="off"),
        pytest.param("approximate", [639, 0], id="approximate-from-dispatch"),
        pytest.param("precise", [639, 0], id="precise-falls-back-before-any-event"),
    ],
)
def test_modes_after_dispatch(mode: str, expected: list[int]) -> None:
    index = PrefixIndex(PrefixIndexConfig(mode=mode))  # type: ignore[arg-type]
    a, b = endpoint("a", engine="vllm"), endpoint("b", engine="vllm")
    index.record(prompt(PROMPT), a, NOW_S)
    assert index.lookup(prompt(PROMPT), [a, b], NOW_S) == expected


def test_precise_overrides_approximate_where_events_are_alive() -> None:
    index = PrefixIndex(PrefixIndexConfig(mode="precise"))
    a, b = endpoint("a", engine="vllm"), endpoint("b", engine="vllm")
    index.record(prompt(PROMPT), a, NOW_S)  # approximate believes `a` holds it
    index.on_kv_batch("a", batch(stored(PROMPT), removed(PROMPT, [0]), at_s=NOW_S))  # the engine says it does not
    index.on_kv_batch("b", batch(stored(PROMPT), at_s=NOW_S))
    assert index.lookup(prompt(PROMPT), [a, b], NOW_S) == [0, 639]


def test_precise_falls_back_to_approximate_after_gap() -> None:
    index = PrefixIndex(PrefixIndexConfig(mode="precise", advanced=PrefixIndexAdvanced(resync_s=30.0)))
    a = endpoint("a", engine="vllm")
    index.on_kv_batch("a", batch(stored(PROMPT), at_s=NOW_S))
    index.record(prompt(PROMPT), a, NOW_S)
    index.on_kv_reset("a", RESET_GAP, NOW_S)
    report = index.report(NOW_S + 1)
    assert report.precise_alive == {"a": False}
    assert index.lookup(prompt(PROMPT), [a], NOW_S + 1) == [639]  # approximate, warm from dispatch


def test_report_counts_memory() -> None:
    index = PrefixIndex(PrefixIndexConfig(mode="precise"))
    index.record(prompt(PROMPT), endpoint("a"), NOW_S)
    index.on_kv_batch("b", batch(stored(PROMPT), at_s=NOW_S))
    report = index.report(NOW_S)
    assert report.approximate_entries == 10 and report.precise_blocks == 80 and report.memory_bytes > 0
    index.retain([])
    after = index.report(NOW_S)
    assert (after.approximate_entries, after.precise_blocks) == (0, 0)
    assert after.memory_bytes < report.memory_bytes

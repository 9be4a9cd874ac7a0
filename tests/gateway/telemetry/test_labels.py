from __future__ import annotations

import pytest

from gateway.telemetry.families import MAX_VALUE_CHARS, OTHER, LabelGuard


@pytest.mark.parametrize(
    ("allowed", "values", "expected"),
    [
        pytest.param(None, ["a", "b", "a"], ["a", "b", "a"], id="first-come-under-cap"),
        pytest.param(None, ["a", "b", "c", "d", "a"], ["a", "b", "c", OTHER, "a"], id="past-cap-folds"),
        pytest.param(["x", "y"], ["x", "zzz", "y", ""], ["x", OTHER, "y", ""], id="allow-list"),
    ],
)
def test_guard_folds_values_beyond_the_cap_or_the_allow_list(
    allowed: list[str] | None, values: list[str], expected: list[str]
) -> None:
    guard = LabelGuard(3, allowed)
    assert [guard(v) for v in values] == expected


def test_guard_cuts_long_values_and_counts_overflow() -> None:
    guard = LabelGuard(1)
    assert guard("m" * 1000) == "m" * MAX_VALUE_CHARS
    assert guard("another") == OTHER
    assert guard.overflowed == 1


def test_guard_memo_stays_bounded_under_junk() -> None:
    guard = LabelGuard(2)
    for i in range(10_000):
        guard(f"junk-{i}")
    assert len(guard) == 4 * 2  # the two admitted and six refused, then refusals stop being remembered
    assert guard.overflowed == 10_000 - 2


def test_allow_replaces_the_list_and_forgets_seen_values() -> None:
    guard = LabelGuard(10, ["a"])
    assert guard("b") == OTHER
    guard.allow(["a", "b"])
    assert guard("b") == "b"


def test_the_memo_of_seen_values_is_bounded_in_bytes() -> None:
    """Client strings (a 100 KB model name on a 404) must not be kept whole as memo keys."""
    guard = LabelGuard(2)
    for i in range(1000):
        guard(f"{i:04d}" + "x" * 100_000)
    assert len(guard) == 4 * 2 and guard.memo_chars == 4 * 2 * MAX_VALUE_CHARS  # cut before remembered


def test_a_flood_of_client_values_leaves_the_memo_at_its_bound_and_the_labels_right() -> None:
    """First come, first labelled: after 20,000 distinct client-chosen values (all long), the memo
    holds 4 x the cap, each key cut; the values admitted before keep their own label, every later
    one is OTHER, and each was counted as folded."""
    guard = LabelGuard(5)
    admitted = [guard(f"tenant-{i}") for i in range(5)]
    assert admitted == [f"tenant-{i}" for i in range(5)]
    for i in range(20_000):
        assert guard(f"junk-{i}-" + "q" * (200 + i % 400)) == OTHER
    assert len(guard) == 4 * 5
    assert guard.memo_chars == 5 * len("tenant-0") + 15 * MAX_VALUE_CHARS  # entries x bytes
    assert [guard(f"tenant-{i}") for i in range(5)] == admitted  # still their own series
    assert guard("junk-3-" + "q" * 203) == OTHER  # a remembered refusal
    assert guard.overflowed == 20_000

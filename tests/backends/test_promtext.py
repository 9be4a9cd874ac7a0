"""The Prometheus text reader: only wanted names, labels with escapes, odd lines skipped."""

from __future__ import annotations

import pytest

from backends.adapters.base import MAX_SAMPLE_VALUE, first_present, mean, parse_samples, total


def test_reads_wanted_names_with_labels() -> None:
    text = (
        "# HELP a help\n# TYPE a gauge\n"
        'a{x="1",y="two words"} 3.5\n'
        'a{x="2"} 1e3 1712345678000\n'
        "b 7\n"
        'a_bucket{le="+Inf"} 9\n'
    )
    assert parse_samples(text, {"a"}) == {"a": [({"x": "1", "y": "two words"}, 3.5), ({"x": "2"}, 1000.0)]}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('m{l="a\\"b"} 1', {"l": 'a"b'}),
        ('m{l="a,b}c"} 1', {"l": "a,b}c"}),
        ('m{l="back\\\\slash",} 1', {"l": "back\\slash"}),
        ('m{l="new\\nline"} 1', {"l": "new\nline"}),
    ],
    ids=["escaped-quote", "comma-and-brace", "backslash-trailing-comma", "newline"],
)
def test_label_values(line: str, expected: dict[str, str]) -> None:
    assert parse_samples(line, {"m"})["m"][0][0] == expected


@pytest.mark.parametrize("line", ["m", "m{", "m not-a-number", "m NaN", 'm{x="1"}'], ids=str)
def test_malformed_or_nan_lines_are_skipped(line: str) -> None:
    assert parse_samples(line, {"m"}) == {}


@pytest.mark.parametrize("value", ["+Inf", "-Inf", "Inf", "1e300", "-1e300", "9007199254740994"], ids=str)
def test_values_past_the_bound_are_dropped(value: str) -> None:
    """An infinite or absurd gauge is unusable: kept, it made `int()` raise in the adapters (the
    scrape failed with a traceback every tick) or a sum of two samples infinite."""
    assert parse_samples(f"m {value}\nm 2", {"m"}) == {"m": [({}, 2.0)]}


def test_sums_of_the_largest_samples_stay_finite() -> None:
    samples = parse_samples("\n".join([f"m {MAX_SAMPLE_VALUE:.0f}"] * 1000), {"m"})
    assert total(samples["m"]) == 1000 * MAX_SAMPLE_VALUE


def test_aggregates() -> None:
    samples = parse_samples("new 1\nold 5\nnew 3\n", {"new", "old"})
    assert first_present(samples, ("new", "old")) == [({}, 1.0), ({}, 3.0)]
    assert first_present(samples, ("missing",)) is None
    assert total(samples["new"]) == 4.0
    assert mean(samples["new"]) == 2.0
    assert total(None) is None and mean(None) is None and mean([]) is None

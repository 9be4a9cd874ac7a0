"""An upstream's `usage` is read as billing needs it, in one place (`backends.types.usage_count`):
counts are non-negative integers whatever an engine or a provider sent, and no reader of usage
parses a count by hand (a negative count would refund a budget; a count that is not a number would
fail the settlement)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backends.types import usage_count

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("value", "read"),
    [(7, 7), (0, 0), (-5, 0), (2.7, 2), (float("nan"), 0), (float("inf"), 0), (1e300, 0), ("12", 12), ("-3", 0),
     ("x", 0), ("9" * 5000, 0), ("\u00b2", 0), (None, 0), (True, 0), ([3], 0), ({"n": 1}, 0)],
)  # fmt: skip
def test_a_count_is_a_non_negative_integer_whatever_was_sent(value: object, read: int) -> None:
    assert usage_count(value) == read


# `int(usage.get("output_tokens") or 0)`, `int((details.get("cached_tokens") ...) or 0)` and the like:
# a usage count parsed by hand
_HAND_PARSED = re.compile(r"int\(\(?\s*\w+\.get\(\s*\"\w*(?:[Tt]okens?|TokenCount)\w*\"")


def test_no_reader_of_usage_parses_a_count_by_hand() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for room in ("gateway", "policies", "predictor", "backends")  # sim is the upstream, not a reader
        for path in sorted((ROOT / room).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _HAND_PARSED.search(line)
    ]
    assert not found, f"read these counts with backends.types.usage_count: {found}"

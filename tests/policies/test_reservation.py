"""The output reservation: max_tokens when given; never below min_tokens; ignore_eos reserves the context."""

from __future__ import annotations

from typing import Any

import pytest

from policies.estimate import output_reservation


@pytest.mark.parametrize(
    ("body", "max_tokens", "expected"),
    [
        pytest.param({}, 100, 100, id="max-tokens"),
        pytest.param({"n": 3}, 100, 300, id="max-tokens-times-n"),
        pytest.param({}, None, 64, id="estimate"),
        pytest.param({"min_tokens": 1000}, None, 1000, id="min-tokens-above-estimate"),
        pytest.param({"min_tokens": 10}, None, 64, id="min-tokens-below-estimate"),
        pytest.param({"min_tokens": 1000, "n": 2}, None, 2000, id="min-tokens-times-n"),
        pytest.param({"ignore_eos": True}, None, 8192 - 500, id="ignore-eos-reserves-the-context"),
        pytest.param({"ignore_eos": True}, 50, 50, id="ignore-eos-with-max-tokens"),
        pytest.param({"min_tokens": "lots", "ignore_eos": "yes"}, None, 64, id="junk-ignored"),
    ],
)
def test_output_reservation(body: dict[str, Any], max_tokens: int | None, expected: int) -> None:
    got = output_reservation(body, max_tokens=max_tokens, estimate_tokens=64, context_length=8192, prompt_tokens=500)
    assert got == expected


def test_ignore_eos_without_a_known_context_falls_back_to_the_estimate() -> None:
    assert output_reservation({"ignore_eos": True}, max_tokens=None, estimate_tokens=64, context_length=None,
                              prompt_tokens=10) == 64  # fmt: skip

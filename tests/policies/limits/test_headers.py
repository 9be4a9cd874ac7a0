"""OpenAI-style rate-limit and retry headers."""

from __future__ import annotations

import pytest

from policies.limits.admission import go_duration, ratelimit_headers, retry_headers, usd


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0, "0s"),
        (0.012, "12ms"),
        (0.0001, "1ms"),
        (1, "1s"),
        (1.146, "1.146s"),
        (1.5, "1.5s"),
        (179.56, "2m59.56s"),
        (360, "6m0s"),
        (3600, "1h0m0s"),
        (3723.5, "1h2m3.5s"),
    ],
)
def test_go_duration(seconds: float, expected: str) -> None:
    assert go_duration(seconds) == expected


def test_ratelimit_headers_floor_remaining_at_zero() -> None:
    assert ratelimit_headers("tokens", 1000, -50.5, 1.5) == [
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "1.5s"),
    ]


def test_retry_headers_round_up_and_stop_auto_retry_past_a_minute() -> None:
    assert retry_headers(0.2) == [("retry-after", "1"), ("retry-after-ms", "200")]
    assert retry_headers(1.0001) == [("retry-after", "2"), ("retry-after-ms", "1001")]
    assert ("x-should-retry", "false") in retry_headers(61)


@pytest.mark.parametrize(
    ("amount", "text"),
    [(5.0, "5.00"), (0.05, "0.05"), (0.005, "0.005"), (0.000123, "0.000123"), (1.23456789, "1.234568"),
     (0.0, "0.00"), (4e-8, "4e-08"), (12.5, "12.50")],
)  # fmt: skip
def test_dollars_keep_the_digits_a_small_budget_needs(amount: float, text: str) -> None:
    assert usd(amount) == text

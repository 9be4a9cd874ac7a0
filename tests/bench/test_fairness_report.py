"""The fairness report's service measure: a request's tokens counted where the engine processed them."""

from __future__ import annotations

from typing import Any

import pytest

from bench.fairness.report import processed_in


def row(sent_s: float, ttft_s: float, e2e_s: float, prompt: int = 300, cached: int = 0, output: int = 100) -> Any:
    return {
        "sent_s": sent_s,
        "ttft_s": ttft_s,
        "e2e_s": e2e_s,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": output,
    }


def test_the_prompt_counts_at_the_first_token_and_the_output_evenly_until_the_end() -> None:
    straddling = row(58.0, 1.0, 5.0)  # first token at 59 s, the output from 59 to 63 s
    assert processed_in(straddling, 0.0, 60.0) == pytest.approx(300 + 100 * 1 / 4)
    assert processed_in(straddling, 60.0, 120.0) == pytest.approx(100 * 3 / 4)
    cached = row(10.0, 0.5, 0.5, cached=200, output=1)  # one token, at once: all at the first token
    assert processed_in(cached, 0.0, 60.0) == pytest.approx(101)
    assert processed_in(cached, 60.0, 120.0) == 0.0

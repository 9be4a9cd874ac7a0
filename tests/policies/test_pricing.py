"""Cost = usage x price table, cached input at its own price."""

from __future__ import annotations

import pytest

from policies.policy import price_usd
from policies.types import Usage
from tests.policies.limits.support import policy


def test_price_uses_cached_input_price_and_defaults_it_to_input() -> None:
    p = policy()
    # big: input $10/M, cached $1/M, output $30/M; small: input $1/M (cached defaults to it), output $2/M
    assert price_usd(p, "big", Usage(1000, 100, cached_tokens=600)) == pytest.approx(
        400 * 10e-6 + 600 * 1e-6 + 100 * 30e-6
    )
    assert price_usd(p, "small", Usage(1000, 100, cached_tokens=600)) == pytest.approx(1000 * 1e-6 + 100 * 2e-6)
    assert price_usd(p, "unpriced", Usage(1000, 100)) == 0.0


def test_a_batch_line_pays_the_batch_share() -> None:
    p = policy(batch={"price_factor": 0.4})
    usage = Usage(1000, 100)
    assert price_usd(p, "small", usage, batch=True) == pytest.approx(0.4 * price_usd(p, "small", usage))

"""Spill-over priced (`spill.usd_per_wait_second`): a request's predicted wait, valued in USD per
second, against what the overflow pool costs it more, in USD (docs/providers.md, "Spill-over")."""

from __future__ import annotations

import pytest

from policies.limits.plan import Price
from policies.policy import extra_usd, worth_spilling
from policies.schema import SpillPolicy

M = 1e-6
OWNED = Price(0.2 * M, 0.2 * M, 0.8 * M)  # a self-hosted pool's price, per token
HOSTED = Price(3.0 * M, 0.3 * M, 15.0 * M, long=Price(6.0 * M, 0.6 * M, 22.5 * M), long_above_tokens=200_000)


def test_the_extra_is_the_difference_at_plain_rates_for_the_requests_tokens() -> None:
    # 2000 prompt tokens and 500 predicted output tokens
    assert extra_usd(OWNED, HOSTED, 2000, 500) == pytest.approx(2000 * 2.8 * M + 500 * 14.2 * M)
    assert extra_usd(HOSTED, OWNED, 2000, 500) == pytest.approx(-extra_usd(OWNED, HOSTED, 2000, 500))
    # a long prompt pays the overflow's long-context table for the whole request
    assert extra_usd(OWNED, HOSTED, 300_000, 100) == pytest.approx(300_000 * 5.8 * M + 100 * 21.7 * M)


@pytest.mark.parametrize(
    ("wait_s", "usd_per_s", "extra", "spills"),
    [
        (2.0, 0.01, 0.0131, True),  # 2 s x $0.01/s = $0.02 > $0.0131
        (1.0, 0.01, 0.0131, False),  # $0.01 < $0.0131: cheaper to wait
        (1.31, 0.01, 0.0131, False),  # equal is not more: it waits
        (5.0, 0.0, 0.0, False),  # a wait worth nothing never pays for an equal price
        (5.0, 0.0, -0.001, True),  # a cheaper overflow pool is worth any wait
        (0.0, 1.0, 0.0, False),  # nobody ahead: it goes now, nothing to weigh
        (None, 1.0, 0.0, False),  # no drain rate to predict by: the fixed bounds decide
    ],
)
def test_it_spills_when_the_waits_value_exceeds_the_extra_price(
    wait_s: float | None, usd_per_s: float, extra: float, spills: bool
) -> None:
    assert worth_spilling(wait_s, usd_per_s, extra) is spills


def test_the_policy_is_off_by_default() -> None:
    assert SpillPolicy().usd_per_wait_second is None
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        SpillPolicy.model_validate({"usd_per_wait_second": -1})

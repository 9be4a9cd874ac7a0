"""Virtual token counters (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI '24).

Each (pool, band) keeps one counter per tenant: the service it received, in tokens, divided by its
weight. Inside a band the waiting tenant with the smallest counter goes next, so over any busy period
two backlogged tenants receive service in the ratio of their weights, within about one request's
cost of each other.

Three rules keep the counters honest:

- *charge at dispatch*: a dispatched request advances its tenant's counter by its predicted cost
  (uncached prompt tokens + predicted output tokens) ÷ weight, so the next decision already sees it;
- *correct at the end*: when the request ends, the difference between its real and predicted cost
  (÷ weight) is added, so a tenant whose outputs run longer than predicted is not favoured for long.
  A refund (real cost below the prediction) is held back and credited at the tenant's next dispatch
  instead: a request ends exactly when a batch slot frees, so a refund landing then would lower the
  flooding tenant's counter at the one moment a waiting light tenant should win the slot;
- *no banked credit*: a tenant with nothing waiting in the band that starts waiting again is lifted
  to the band's current minimum (the smallest counter among the tenants waiting there, or, with
  nobody waiting, the counter of the tenant served last). Idling earns no priority later; usage
  while others waited is remembered.

Everything here is a pure function of numbers; where the counters live is `counters.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def band_floor(counters: Mapping[str, float], waiting_tenants: Iterable[str], last_served: float) -> float:
    """The counter a returning tenant starts from: the least among the waiting tenants, else the
    counter of the tenant served last."""
    floor: float | None = None
    for tenant in waiting_tenants:
        value = counters.get(tenant, 0.0)
        if floor is None or value < floor:
            floor = value
    return last_served if floor is None else floor


def lifted(counter: float, floor: float) -> float:
    """A returning tenant's counter: never below the band's floor (no banked credit), never lowered."""
    return counter if counter >= floor else floor


def credited(counter: float, credit: float, floor: float | None) -> float:
    """A counter at dispatch: lifted to `floor` (a tenant coming back; None: it was waiting all along),
    then `credit` (held-back refunds, ≤ 0) taken off, never below that floor (no banked credit)."""
    if floor is None:
        return counter + credit
    value = counter if counter >= floor else floor
    value += credit
    return value if value >= floor else floor


def charge(cost_tokens: float, weight: float) -> float:
    """What a dispatch adds to its tenant's counter."""
    return max(cost_tokens, 0.0) / weight


def correction(predicted_cost_tokens: float, actual_cost_tokens: float, weight: float) -> float:
    """What a finished request adds to (or takes from) its tenant's counter: real minus predicted."""
    return (max(actual_cost_tokens, 0.0) - max(predicted_cost_tokens, 0.0)) / weight


def request_cost(prompt_tokens: int, cached_tokens: int, output_tokens: float) -> float:
    """Tokens a request costs the pool: the prompt tokens it must compute plus the tokens it generates."""
    return max(prompt_tokens - cached_tokens, 0) + max(output_tokens, 0.0)

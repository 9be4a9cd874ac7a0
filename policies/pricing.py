"""What a request cost: usage x the model's price table (USD per million tokens, cached input apart).

Cached prompt tokens (served from the engine's prefix cache) are billed at `cached_input_per_mtok`,
which defaults to the input price. Budgets are charged with this same figure after each request.
Batch lines pay a share of it (`batch.price_factor`, or the model's `price.batch_factor`).
"""

from __future__ import annotations

from policies.policy import Policy
from policies.types import Usage


def price_usd(policy: Policy, model: str, usage: Usage, *, batch: bool = False) -> float:
    """USD cost of `usage` on `model`; 0.0 for a model without a price. A batch line pays the
    model's batch share of it (`Policy.batch_price_factor`)."""
    cost = policy.price(model).cost_usd(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
    return cost * policy.batch_price_factor(model) if batch else cost

"""Spill-over priced: is a request's predicted wait for its owned pool worth more than what the
overflow pool costs it more? (`spill.usd_per_wait_second`, docs/providers.md, "Spill-over".)

The gate's spill check (`gateway/flow/spill.py`) asks this on every wake of the owned pool's room,
next to its two fixed bounds (`max_wait_ms`, `max_waiting`), so the policy can only make a request
spill sooner, never hold it longer. Plain functions of numbers and price tables: the check brings
the prediction (the room's drain rate) and the prices (`Policy.price(model, pool)`).
"""

from __future__ import annotations

from policies.limits.types import Price


def extra_usd(owned: Price, overflow: Price, prompt_tokens: int, output_tokens: int) -> float:
    """USD the overflow pool costs a request of `prompt_tokens` and `output_tokens` more than the owned
    pool (negative when it is cheaper). Both at their plain rates, the long-context tier included: a
    prompt cache hit on either side is not known before the call, so neither is assumed."""
    return overflow.uncached_usd(prompt_tokens, output_tokens) - owned.uncached_usd(prompt_tokens, output_tokens)


def worth_spilling(predicted_wait_s: float | None, usd_per_wait_second: float, extra: float) -> bool:
    """Spill when waiting would cost more than spilling: `predicted_wait_s` (s) x `usd_per_wait_second`
    (USD/s) > `extra` (USD). No prediction (None: nothing has left the room lately to measure it by) or
    no wait ahead (0) never spills on price: the fixed bounds decide then. An overflow pool cheaper
    than the owned one (`extra` < 0) is worth any wait, even one valued at nothing."""
    if predicted_wait_s is None or predicted_wait_s <= 0.0:
        return False
    return predicted_wait_s * usd_per_wait_second > extra

"""How many output tokens a request reserves before it runs.

`max_tokens` (x `n`) when the client set it. Without it the reservation is the model's
`default_max_tokens`, which the gateway then sends the engine as the request's output limit
(`gateway/upstream/engine_control.py`: no answer outgrows its reservation), and two request fields make the
engine generate more than an estimate: `min_tokens` (vLLM, TensorRT-LLM: at least that many, EOS or
not) and `ignore_eos` (generate until `max_tokens`, which is then the model's context). Reserving the
estimate for those let 100 concurrent requests with `min_tokens: 1000` pass a 2,000 TPM limit ten
times over in one burst. So the reservation is never below `min_tokens`, and `ignore_eos` without
`max_tokens` reserves what the context leaves after the prompt: such a request is admitted when a
whole context fits its limits, and a limit too small for that rejects it as too large, up front,
with `x-should-retry: false` (rather than admitting it on a guess it will overrun).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def output_reservation(
    body: Mapping[str, Any],
    *,
    max_tokens: int | None,
    estimate_tokens: int,
    context_length: int | None,
    prompt_tokens: int,
) -> int:
    """The output tokens to reserve for `body` (all of its `n` choices)."""
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    if max_tokens is not None:
        return max_tokens * choices
    per_choice = max(estimate_tokens, _count(body.get("min_tokens")) or 0)
    if body.get("ignore_eos") is True and context_length is not None:
        per_choice = max(per_choice, context_length - prompt_tokens, 1)
    return per_choice * choices

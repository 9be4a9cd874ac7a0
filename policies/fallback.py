"""What to run instead: the next model of a fallback chain, and the context-length check before a call.

Pure functions of (policy, model, trigger, principal). A chain is the model's own `fallbacks` list,
followed transitively (a fallback's own fallbacks come after), each step gated by the triggers it
lists; `tried` lets the caller walk it without cycles whether it passes the original model or the one
it just tried.
"""

from __future__ import annotations

from collections.abc import Collection

from policies.policy import Policy
from policies.types import Principal, Rejection


def choose_fallback(
    policy: Policy,
    model: str,
    trigger: str,
    principal: Principal,
    opt_out: bool = False,
    *,
    tried: Collection[str] = (),
    min_context_tokens: int | None = None,
) -> str | None:
    """The first model of `model`'s chain that `trigger` may use, the caller may call, and that was not
    tried; None when the tenant disallows fallbacks, the request opted out, or none is left.
    For `context_too_long`, `min_context_tokens` (prompt + max_tokens) skips models too small."""
    if opt_out or not principal.allow_fallback:
        return None
    seen = {model}
    queue = [model]
    while queue:
        current = queue.pop(0)
        for step in policy.fallbacks(current):
            candidate = step.model
            if trigger not in step.triggers or candidate in seen:
                continue  # a step the trigger may not take also hides what lies behind it
            seen.add(candidate)
            queue.append(candidate)
            if candidate in tried or not principal.may_use(candidate):
                continue
            if trigger == "context_too_long" and not _fits(policy, candidate, min_context_tokens):
                continue
            return candidate
    return None


def _fits(policy: Policy, model: str, need_tokens: int | None) -> bool:
    config = policy.model_config(model)
    if config is None or config.context_length is None or need_tokens is None:
        return True
    return need_tokens <= config.context_length


def context_tokens(prompt_tokens: int, max_tokens: int | None) -> int:
    """Context a request needs: prompt + max_tokens, or prompt + 1 (room for one token) without it."""
    return prompt_tokens + (max_tokens if max_tokens is not None else 1)


def check_context(policy: Policy, model: str, prompt_tokens: int, max_tokens: int | None) -> Rejection | None:
    """400 `context_length_exceeded` (param `messages`, reason `context_too_long`) when prompt +
    max_tokens exceed the model's context length; None when it fits or the length is unknown."""
    config = policy.model_config(model)
    if config is None or config.context_length is None:
        return None
    needed = context_tokens(prompt_tokens, max_tokens)
    if needed <= config.context_length:
        return None
    completion = f"{max_tokens} in the completion" if max_tokens is not None else "at least 1 in the completion"
    message = (
        f"This model's maximum context length is {config.context_length} tokens. However, you requested "
        f"{needed} tokens ({prompt_tokens} in the messages, {completion}). "
        "Please reduce the length of the messages or completion."
    )
    return Rejection(
        status=400,
        message=message,
        type="invalid_request_error",
        code="context_length_exceeded",
        param="messages",
        reason="context_too_long",
    )

"""Program identity: which agent program (one task's run of many calls) a request belongs to.

An agent's task is tens of calls whose prompts grow each turn; billing and scheduling them one by one
hides the task. Clients already name it, in several ways, so the first one present wins:

1. `x-tokenway-program` — the gateway's own header, for clients that set it on purpose;
2. the session headers agent runtimes send (`x-session-id`, `x-claude-code-session-id`,
   `x-session-affinity`);
3. Anthropic Messages' `metadata.user_id` (Claude Code writes its session into it);
4. OpenAI's `prompt_cache_key`, then `user` (a stable end-user or conversation identifier).

The value is client input that reaches the ledger, the console and (later) maps keyed by program, so
it is bounded like session keys (`policies/routing/session.py`): kept as sent when short valid text,
else '#' + a 128-bit hash of its bytes, so the same program always gets the same id. It is read once
at intake from the already-parsed body (no second parse) and costs a few dictionary look-ups.
Programs are per tenant: two tenants' "run-1" are different programs (the record carries both).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from policies.routing.session import MAX_SESSION_KEY_CHARS, bounded_key

PROGRAM_HEADER: Final = "x-tokenway-program"
SESSION_HEADERS: Final = ("x-session-id", "x-claude-code-session-id", "x-session-affinity")
MAX_PROGRAM_CHARS: Final = MAX_SESSION_KEY_CHARS  # longer ids are kept as '#' + 32 hex characters


def program_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The request's bounded program id from the first source present, or None when it names none."""
    value = headers.get(PROGRAM_HEADER)
    if not value:
        for name in SESSION_HEADERS:
            value = headers.get(name)
            if value:
                break
        else:
            value = _body_program(body)
            if value is None:
                return None
    return bounded_key(value)


def _body_program(body: Mapping[str, Any]) -> str | None:
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        user_id = metadata.get("user_id")
        if isinstance(user_id, str) and user_id:
            return user_id
    for field in ("prompt_cache_key", "user"):
        value = body.get(field)
        if isinstance(value, str) and value:
            return value
    return None

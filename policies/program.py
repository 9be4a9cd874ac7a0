"""The runaway guard: an agent program stuck in a loop is stopped before it spends the budget.

A looping agent sends the same turn again and again: the same tool result, the same user nudge,
after a history that grows by the same step each time. Its prompts are never equal (they grow), but
their *suffix* — the last message — is, once the ids the runtime mints per call (`tool_call_id`,
`tool_use_id`, `call_id`, `id`) are left out. So each program (gateway/request/program.py) keeps the
digest of its last suffix and how many calls in a row carried it; when a tenant's
`program_max_repeats` is set and a program sends the same suffix more than that many times in a row,
the call is refused with a 429 naming the rule (code `program_loop`). A call with another suffix
starts the count again, so a program that changes course runs on; one that retries the same turn
stays stopped.

State is per gateway process (not shared across replicas: a program spread over N replicas is stopped
after at most N times the limit) and bounded: at most `max_programs` programs per tenant, least recently
seen forgotten first. Tenants without the setting cost one dictionary look-up and keep no state.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Final

import orjson
import xxhash

from policies.types import Rejection

MINTED_IDS: Final = frozenset({"id", "tool_call_id", "tool_use_id", "call_id"})
MAX_PROGRAMS_PER_TENANT: Final = 10_000
_NO_RETRY: Final = ("x-should-retry", "false")


def prompt_suffix(body: dict[str, Any]) -> bytes | None:
    """A 128-bit digest of the request's last turn (chat and Messages: the last message; Responses:
    the last input item, or the input text; completions: the prompt), ids minted per call left out;
    None when the body has no turn to compare."""
    turns = body.get("messages")
    if turns is None:
        turns = body.get("input", body.get("prompt"))
    if isinstance(turns, list):
        if not turns:
            return None
        last: Any = turns[-1]
    elif isinstance(turns, str):
        last = turns
    else:
        return None
    return xxhash.xxh3_128_digest(orjson.dumps(_without_ids(last)))


def _without_ids(value: Any) -> Any:
    """`value` with the per-call ids dropped at every depth (the body's nesting is bounded at parse)."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in MINTED_IDS}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


class RunawayGuard:
    """Per tenant, per program: the last suffix digest and how many calls in a row carried it."""

    def __init__(self, max_programs: int = MAX_PROGRAMS_PER_TENANT) -> None:
        self.max_programs = max_programs
        self._tenants: dict[str, OrderedDict[str, tuple[bytes, int]]] = {}

    def programs(self, tenant: str) -> int:
        """Programs remembered for `tenant` (memory, for tests and metrics)."""
        return len(self._tenants.get(tenant, ()))

    def check(self, tenant: str, program: str, body: dict[str, Any], max_repeats: int) -> Rejection | None:
        """Count this call against its program; a Rejection when it is one repeat too many."""
        suffix = prompt_suffix(body)
        if suffix is None:
            return None
        programs = self._tenants.get(tenant)
        if programs is None:
            programs = self._tenants[tenant] = OrderedDict()
        last = programs.pop(program, None)
        repeats = last[1] + 1 if last is not None and last[0] == suffix else 1
        programs[program] = (suffix, repeats)
        if len(programs) > self.max_programs:
            programs.popitem(last=False)
        if repeats <= max_repeats:
            return None
        return Rejection(
            status=429,
            message=(
                f"Runaway guard: program '{program}' sent the same last turn {repeats} times in a row; tenant "
                f"'{tenant}' allows {max_repeats} (tenants.{tenant}.program_max_repeats). Change the request "
                "or start a new program."
            ),
            type="requests",
            code="program_loop",
            headers=(_NO_RETRY,),
            reason="program_loop",
        )

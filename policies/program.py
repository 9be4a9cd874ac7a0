"""The runaway guard: an agent program stuck in a loop is stopped before it spends the budget.

A looping agent sends the same turn again and again: the same tool result, the same user nudge,
after a history that grows by the same step each time. Its prompts are never equal (they grow), but
their *suffix* — the last message — is, once the ids the runtime mints per call (`tool_call_id`,
`tool_use_id`, `call_id`, `id`) are left out. So each program (gateway/request/intake.py) keeps the
digest of its last suffix and how many calls in a row carried it; when a tenant's
`program_max_repeats` is set and a program sends the same suffix more than that many times in a row,
the call is refused with a 429 naming the rule (code `program_loop`). A call with another suffix
starts the count again, so a program that changes course runs on; one that retries the same turn
stays stopped.

State is per gateway process (not shared across replicas: a program spread over N replicas is stopped
after at most N times the limit) and bounded: at most `max_programs` programs per tenant, least recently
seen forgotten first. Tenants without the setting cost one dictionary look-up and keep no state.

A loop need not repeat one turn: an agent may cycle through K tool calls (read, edit, test, read,
edit, test, ...). Each program also keeps its last `program_max_cycle` suffixes and, per period k up
to that, how many calls in a row equalled the one k calls before; `run // k + 1` is how many times the
last k turns have come round in a row, and more than `program_max_repeats` of any period is refused
the same way. Period 1 is the plain repeat. The cost is K comparisons of 16-byte digests per call.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Final

import orjson
import xxhash

from policies.types import Rejection

MINTED_IDS: Final = frozenset({"id", "tool_call_id", "tool_use_id", "call_id"})
MAX_PROGRAMS_PER_TENANT: Final = 10_000
MAX_CYCLE: Final = 16  # the longest loop period a tenant may ask the guard to look for
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


class _Trail:
    """One program's last suffixes (newest last) and, per period k, the calls in a row that equalled
    the call k before."""

    __slots__ = ("runs", "suffixes")

    def __init__(self) -> None:
        self.suffixes: list[bytes] = []
        self.runs: list[int] = []

    def push(self, suffix: bytes, max_cycle: int) -> tuple[int, int]:
        """Record a call; (period, times the last `period` turns came round in a row) for the shortest
        period that came round most often."""
        suffixes, runs = self.suffixes, self.runs
        if len(runs) != max_cycle:  # the tenant's setting changed: start again
            suffixes.clear()
            runs[:] = [0] * max_cycle
        best = (1, 1)
        for k in range(1, max_cycle + 1):
            run = runs[k - 1] + 1 if len(suffixes) >= k and suffixes[-k] == suffix else 0
            runs[k - 1] = run
            times = run // k + 1
            if times > best[1]:
                best = (k, times)
        suffixes.append(suffix)
        if len(suffixes) > max_cycle:
            del suffixes[0]
        return best


class RunawayGuard:
    """Per tenant, per program: the last suffix digests and how many calls in a row repeated them."""

    def __init__(self, max_programs: int = MAX_PROGRAMS_PER_TENANT) -> None:
        self.max_programs = max_programs
        self._tenants: dict[str, OrderedDict[str, _Trail]] = {}

    def programs(self, tenant: str) -> int:
        """Programs remembered for `tenant` (memory, for tests and metrics)."""
        return len(self._tenants.get(tenant, ()))

    def check(
        self, tenant: str, program: str, body: dict[str, Any], max_repeats: int, max_cycle: int = 1
    ) -> Rejection | None:
        """Count this call against its program; a Rejection when it is one repeat too many."""
        suffix = prompt_suffix(body)
        if suffix is None:
            return None
        programs = self._tenants.get(tenant)
        if programs is None:
            programs = self._tenants[tenant] = OrderedDict()
        trail = programs.pop(program, None) or _Trail()
        period, times = trail.push(suffix, max(1, min(max_cycle, MAX_CYCLE)))
        programs[program] = trail
        if len(programs) > self.max_programs:
            programs.popitem(last=False)
        if times <= max_repeats:
            return None
        if period == 1:
            what = f"sent the same last turn {times} times in a row"
        else:
            what = f"went round the same cycle of {period} turns {times} times in a row"
        return Rejection(
            status=429,
            message=(
                f"Runaway guard: program '{program}' {what}; tenant '{tenant}' allows {max_repeats} "
                f"(tenants.{tenant}.program_max_repeats, loops of up to tenants.{tenant}.program_max_cycle turns). "
                "Change the request or start a new program."
            ),
            type="requests",
            code="program_loop",
            headers=(_NO_RETRY,),
            reason="program_loop",
        )

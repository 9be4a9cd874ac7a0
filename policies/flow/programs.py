"""Program-fair queueing: inside one tenant, the program that has received the least service lately
goes next (least attained service, LAS), so an agent program's 40 parallel calls do not starve
another program's one.

A tenant's share of a saturated pool is the virtual counters' business (`vtc.py`); this module only
orders the requests *of one tenant* among themselves. Each program (gateway/request/program.py) has an
attained service: the tokens it was served (uncached prompt + output, the cost the tenant's counter
is charged, charged at dispatch and corrected by real usage at the end), decayed with a half-life so
that a program served heavily a while ago is not held back forever, and a long-running one does not
lose to every newcomer for good. Among the tenant's waiting requests, the one whose program has the
least attained service goes first; inside one program, arrival order (or shortest job first).

Requests that name no program share one group, `NO_PROGRAM`, which is ordered like any program.
Counting each of them as a program of its own would put every anonymous call at zero service, in
front of every named program: dropping the program id would then be the way to jump the queue, and
each such call would be a table entry. As one group, anonymous traffic gets one program's share.

Why decay and not a window: the decayed value needs two numbers per program (the value and when it
was last changed) and one multiplication to read, and it is the same whichever replica reads it.

State is bounded per tenant (`max_programs`, least recently charged forgotten first: a forgotten
program reads as zero service, the same as a new one). Where it lives is a `ProgramService`: one
process (`MemoryPrograms`) or shared by the replicas through Redis (`redis_programs.py`). Every read
is synchronous: ordering reads it at every pick.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Protocol

NO_PROGRAM: Final = ""  # the group of requests that name no program (program ids are never empty)
MAX_PROGRAMS_PER_TENANT: Final = 4096


def decayed(value: float, elapsed_s: float, half_life_s: float) -> float:
    """`value` after `elapsed_s` seconds of halving every `half_life_s`."""
    if elapsed_s <= 0.0:
        return value
    return value * math.pow(0.5, elapsed_s / half_life_s)


class ProgramService(Protocol):
    """Where programs' attained service lives. `half_life_s` comes with every call: it is the tenant's
    policy, hot-reloaded, and a stored value is only "so much, as of then"."""

    def value(self, tenant: str, program: str, half_life_s: float) -> float:
        """The program's attained service now (0 for a program never charged or forgotten)."""
        ...

    def charge(self, tenant: str, program: str, tokens: float, half_life_s: float) -> None:
        """Add `tokens` (a dispatch's cost, or an end-of-request correction, which may be negative;
        the value never goes below zero)."""
        ...

    def watch(self, tenant: str, program: str, waiting: bool) -> None:
        """The program has requests waiting here (or no longer): a shared store keeps its value fresh."""
        ...

    def programs(self, tenant: str) -> int:
        """Programs remembered for `tenant` (bounded by `max_programs`)."""
        ...

    def status(self) -> dict[str, object]: ...

    async def close(self) -> None: ...


class MemoryPrograms:
    """Attained service of one process: per tenant, program -> (value, when it was last changed),
    least recently charged first, at most `max_programs` of them."""

    source = "memory"

    def __init__(
        self, max_programs: int = MAX_PROGRAMS_PER_TENANT, *, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_programs = max_programs
        self.now = now
        self._tenants: dict[str, OrderedDict[str, tuple[float, float]]] = {}

    def value(self, tenant: str, program: str, half_life_s: float) -> float:
        programs = self._tenants.get(tenant)
        if programs is None:
            return 0.0
        found = programs.get(program)
        if found is None:
            return 0.0
        return decayed(found[0], self.now() - found[1], half_life_s)

    def charge(self, tenant: str, program: str, tokens: float, half_life_s: float) -> None:
        programs = self._tenants.get(tenant)
        if programs is None:
            programs = self._tenants[tenant] = OrderedDict()
        now = self.now()
        found = programs.pop(program, None)
        value = tokens if found is None else decayed(found[0], now - found[1], half_life_s) + tokens
        programs[program] = (max(value, 0.0), now)
        if len(programs) > self.max_programs:
            programs.popitem(last=False)

    def watch(self, tenant: str, program: str, waiting: bool) -> None:
        return None

    def programs(self, tenant: str) -> int:
        return len(self._tenants.get(tenant, ()))

    def status(self) -> dict[str, object]:
        return {"store": self.source, "programs": sum(len(p) for p in self._tenants.values())}

    async def close(self) -> None:
        return None

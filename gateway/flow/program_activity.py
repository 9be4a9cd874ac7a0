"""Which programs of a tenant are active in a pool, as counts the program slot reserve reads in O(1).

The program reserve (`policies/flow/program_reserve.py`) asks, for one request: how many requests
does its program hold in flight in the pool, how many does its tenant, how many of the tenant's
programs are active there, and how many of them are light (nothing waiting). A walk over the
tenant's programs per request would cost as much as the tenant has programs; here each change
(a dispatch, an end, a request entering or leaving the room) updates the per-tenant totals, and a
question reads them.

A program is active while it has requests in flight or waiting, and `active_s` after its last one
(an agent between two turns runs a tool: it comes back). Only tenants with program fairness are
counted (the room and the lease say so). Expiry is lazy: programs sit in least-recently-changed
order, and each read forgets a few idle ones past `active_s` from the front; a busy one found there
goes to the back (it is active whatever its age), so a read does bounded work.

Bounded: at most `max_groups` (pool, tenant) groups, and `max_programs` programs per group; a
program forgotten to make room takes its counts with it (its later end is ignored: counts never go
below zero).

Per replica: each gateway counts the requests it dispatched. A program whose calls are spread over
several replicas is judged on each replica's part of it, which keeps the same proportions when the
calls are spread evenly (the endpoints' free slots, the other input of the decision, are fleet-wide:
`policies/flow/reserve.py` `free_on`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from policies.flow.program_reserve import Standing

_MAX_GROUPS: Final = 4096
_MAX_PROGRAMS: Final = 4096
_EXPIRE_PER_READ: Final = 8  # idle programs forgotten (or busy ones passed) per read, at most


@dataclass(slots=True)
class _Program:
    inflight: int = 0
    waiting: int = 0
    last_s: float = 0.0


@dataclass(slots=True)
class _Group:
    programs: OrderedDict[str, _Program] = field(default_factory=OrderedDict)
    inflight: int = 0  # the programs' requests in flight, summed
    waiting_programs: int = 0  # programs with a request waiting


@dataclass(slots=True)
class ProgramActivity:
    active_s: float = 10.0
    max_groups: int = _MAX_GROUPS
    max_programs: int = _MAX_PROGRAMS
    now: Callable[[], float] = field(default=time.monotonic)
    _groups: dict[tuple[str, str], _Group] = field(default_factory=dict)

    def inflight(self, pool: str, tenant: str, program: str, delta: int) -> None:
        """A request of `program` was dispatched (+1) or ended (-1) in `pool`."""
        group, seen = self._touch(pool, tenant, program, create=delta > 0)
        if seen is None or group is None:
            return
        before = seen.inflight
        seen.inflight = max(before + delta, 0)
        group.inflight = max(group.inflight + seen.inflight - before, 0)

    def waiting(self, pool: str, tenant: str, program: str, delta: int) -> None:
        """A request of `program` entered (+1) or left (-1) `pool`'s waiting room."""
        group, seen = self._touch(pool, tenant, program, create=delta > 0)
        if seen is None or group is None:
            return
        before = seen.waiting
        seen.waiting = max(before + delta, 0)
        if before == 0 and seen.waiting > 0:
            group.waiting_programs += 1
        elif before > 0 and seen.waiting == 0:
            group.waiting_programs = max(group.waiting_programs - 1, 0)

    def standing(self, pool: str, tenant: str, program: str) -> Standing:
        """The program's standing in its tenant now (a program never seen counts as active, with
        nothing in flight or waiting: it is asking)."""
        group = self._groups.get((pool, tenant))
        if group is None:
            return Standing(0, 0, 1, 0)
        self._expire(group)
        seen = group.programs.get(program)
        active = len(group.programs)
        light = active - group.waiting_programs
        if seen is None:
            return Standing(0, group.inflight, active + 1, light)
        if seen.waiting == 0:
            light -= 1  # itself
        return Standing(seen.inflight, group.inflight, active, light)

    def status(self) -> dict[str, object]:
        """Per pool and tenant: programs active, requests in flight, programs waiting (`/admin/status`)."""
        out: dict[str, object] = {}
        for (pool, tenant), group in sorted(self._groups.items()):
            self._expire(group)
            out[f"{pool}/{tenant}"] = {
                "programs": len(group.programs),
                "inflight": group.inflight,
                "waiting_programs": group.waiting_programs,
            }
        return out

    # --- parts ------------------------------------------------------------------------------------

    def _touch(self, pool: str, tenant: str, program: str, *, create: bool) -> tuple[_Group | None, _Program | None]:
        key = (pool, tenant)
        group = self._groups.get(key)
        if group is None:
            if not create:
                return None, None
            if len(self._groups) >= self.max_groups:
                self._drop_a_group()
            group = self._groups[key] = _Group()
        seen = group.programs.get(program)
        if seen is None:
            if not create:
                return group, None
            if len(group.programs) >= self.max_programs:
                self._forget(group, next(iter(group.programs)))
            seen = group.programs[program] = _Program()
        else:
            group.programs.move_to_end(program)
        seen.last_s = self.now()
        return group, seen

    def _expire(self, group: _Group) -> None:
        programs = group.programs
        cutoff = self.now() - self.active_s
        for _ in range(min(_EXPIRE_PER_READ, len(programs))):
            name, seen = next(iter(programs.items()))
            if seen.last_s >= cutoff:
                return  # the rest changed later still
            if seen.inflight or seen.waiting:
                programs.move_to_end(name)  # busy: active whatever its age
                continue
            del programs[name]

    def _forget(self, group: _Group, program: str) -> None:
        seen = group.programs.pop(program)
        group.inflight = max(group.inflight - seen.inflight, 0)
        if seen.waiting:
            group.waiting_programs = max(group.waiting_programs - 1, 0)

    def _drop_a_group(self) -> None:
        """Room for a new group: one with nothing in flight or waiting goes, else the oldest."""
        for key, group in self._groups.items():
            if not group.inflight and not group.waiting_programs:
                del self._groups[key]
                return
        del self._groups[next(iter(self._groups))]

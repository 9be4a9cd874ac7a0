"""Programs' attained service shared by several gateway replicas through Redis (program-fair
queueing, `programs.py`), the way `redis_counters.py` shares the tenants' virtual counters.

Each replica orders its own waiting room from a local view, changed at once by its own dispatches
and corrections, so ordering never waits on Redis. Changes gather per tenant for `flush_s` and go
out as one atomic script call per tenant (`program_batch.lua`), at most one flush in flight. A
change is an add (tokens), and adds commute with each other and with the decay (the decay is a
multiplication of the whole value), so a batch leaves Redis where the calls one by one would have,
up to the decay of `flush_s` (a 5 ms flush against a 60 s half-life: 6e-5 of a value).

The reply carries, decayed to Redis's clock now, every program the call changed and every program
with requests waiting in this replica (`watch`): the only values ordering reads. While programs
wait, they are re-read every `refresh_s`, so the other replicas' charges arrive even when this one
dispatches nothing. The view decays a value from the moment it heard it, on its own clock; Redis
decays from its clock: both halve at the same rate, so they differ only by the round trip.

A failed call keeps its changes in this replica's view only (counted; fairness among programs
degrades to per replica, requests never fail on it). Keys carry the `{prefix}` hash tag; a tenant's
programs expire after a day without changes and at most `max_programs` are kept per tenant in Redis
and in each view, least recently changed forgotten first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from policies.flow.flusher import BatchedFlush
from policies.flow.programs import MAX_PROGRAMS_PER_TENANT, decayed
from policies.limits.resp import load_script
from policies.limits.scriptpipe import script_pipeline

log = logging.getLogger("tokenway.flow.programs")

_TTL_MS = 86_400_000


@dataclass(slots=True)
class _Tenant:
    heard: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)  # value, when (ours)
    sent: dict[str, float] | None = None  # adds in flight, not yet answered
    queued: dict[str, float] = field(default_factory=dict)  # adds not sent yet
    watched: set[str] = field(default_factory=set)  # programs with requests waiting in this replica
    read: bool = False  # a refresh asked for the watched programs
    half_life_s: float = 60.0  # the tenant's, as last given

    def value(self, program: str, now: float) -> float:
        found = self.heard.get(program)
        value = decayed(found[0], now - found[1], self.half_life_s) if found is not None else 0.0
        if self.sent is not None:
            value += self.sent.get(program, 0.0)
        value += self.queued.get(program, 0.0)
        return value if value > 0.0 else 0.0

    def due(self) -> bool:
        return bool(self.queued) or (self.read and bool(self.watched))


class RedisPrograms(BatchedFlush):
    source = "redis"

    def __init__(
        self,
        client: Redis,
        *,
        prefix: str = "tokenway",
        refresh_s: float = 0.1,
        flush_s: float = 0.005,
        max_programs: int = MAX_PROGRAMS_PER_TENANT,
    ) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self.flush_s = flush_s
        self.max_programs = max_programs
        self._tag = "{" + prefix + "}:flow:programs:"
        self._script = load_script("policies.flow", "program_batch.lua")
        self.pipeline = script_pipeline(client, (self._script,))
        self._tenants: dict[str, _Tenant] = {}
        self._init_flush()
        self.calls = 0
        self.errors = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "tokenway",
        refresh_s: float = 0.1,
        flush_s: float = 0.005,
        timeout_s: float = 0.2,
        max_programs: int = MAX_PROGRAMS_PER_TENANT,
    ) -> RedisPrograms:
        client = Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        return cls(client, prefix=prefix, refresh_s=refresh_s, flush_s=flush_s, max_programs=max_programs)

    def keys(self, tenant: str) -> tuple[str, str]:
        base = self._tag + tenant
        return base, base + ":at"

    def _tenant(self, tenant: str, half_life_s: float) -> _Tenant:
        found = self._tenants.get(tenant)
        if found is None:
            found = self._tenants[tenant] = _Tenant()
        found.half_life_s = half_life_s
        return found

    # --- the ProgramService contract ---------------------------------------------------------------

    def value(self, tenant: str, program: str, half_life_s: float) -> float:
        found = self._tenants.get(tenant)
        if found is None:
            return 0.0
        found.half_life_s = half_life_s
        return found.value(program, time.monotonic())

    def charge(self, tenant: str, program: str, tokens: float, half_life_s: float) -> None:
        view = self._tenant(tenant, half_life_s)
        view.queued[program] = view.queued.get(program, 0.0) + tokens
        self._changed()

    def watch(self, tenant: str, program: str, waiting: bool) -> None:
        found = self._tenants.get(tenant)
        if found is None:
            if not waiting:
                return
            found = self._tenants[tenant] = _Tenant()
        if waiting:
            found.watched.add(program)
            if self._refresher is None:
                with contextlib.suppress(RuntimeError):  # no running loop: nothing to refresh from
                    self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())
        else:
            found.watched.discard(program)

    def programs(self, tenant: str) -> int:
        found = self._tenants.get(tenant)
        return len(found.heard) if found is not None else 0

    def status(self) -> dict[str, object]:
        return {
            "store": self.source,
            "programs": sum(len(view.heard) for view in self._tenants.values()),
            "calls": self.calls,  # script calls: one per tenant per flush
            "errors": self.errors,
            "pending": sum(1 for view in self._tenants.values() if view.sent is not None or view.queued),
        }

    # --- Redis ---------------------------------------------------------------------------------

    def _due(self) -> bool:
        return any(view.due() for view in self._tenants.values())

    def _pending(self) -> bool:
        return any(view.queued for view in self._tenants.values())

    async def _flush(self) -> None:
        """Send every tenant's queued adds and a read of its watched programs, one call per tenant."""
        batch = [(tenant, view) for tenant, view in self._tenants.items() if view.due()]
        calls = []
        for tenant, view in batch:
            view.sent, view.queued, view.read = view.queued, {}, False
            args = [str(_TTL_MS), repr(view.half_life_s), str(self.max_programs), str(len(view.sent))]
            for program, tokens in view.sent.items():
                args += [program, repr(tokens)]
            args += [program for program in view.watched if program not in view.sent]
            calls.append(self.pipeline.call(self._script, self.keys(tenant), args))
        await self._answered(batch, calls)

    def _failed(self, view: _Tenant, exc: BaseException) -> None:
        """Adds Redis never got: they stay in this replica's view only."""
        self.errors += 1
        if self.errors == 1 or self.errors % 1000 == 0:
            log.warning("flow programs: Redis call failed (%d so far): %s", self.errors, exc)
        sent, view.sent = view.sent or {}, None
        now = time.monotonic()
        for program, tokens in sent.items():
            found = view.heard.pop(program, None)
            value = decayed(found[0], now - found[1], view.half_life_s) if found is not None else 0.0
            self._heard(view, program, max(value + tokens, 0.0), now)

    def _apply(self, view: _Tenant, reply: Any) -> None:
        now = time.monotonic()
        for program, value in zip(reply[::2], reply[1::2], strict=True):
            name = program.decode() if isinstance(program, bytes) else str(program)
            view.heard.pop(name, None)
            self._heard(view, name, float(value), now)

    def _heard(self, view: _Tenant, program: str, value: float, now: float) -> None:
        view.heard[program] = (value, now)
        if len(view.heard) > self.max_programs:
            view.heard.popitem(last=False)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            asked = False
            for view in self._tenants.values():
                if view.watched:
                    view.read = asked = True
            if asked and self._flush_timer is None and self._flushing is None:
                self._start_flush()

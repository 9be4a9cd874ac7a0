"""The replicas' shared stream: publish this replica's batches, fold in everyone else's.

Hot path: `dispatched` (the router's dispatch listener) appends one tuple to a bounded deque and
returns; nothing per request touches Redis. Two tasks do the rest:

- the publisher wakes every `publish_interval_ms`, and when something changed (a dispatch, or this
  replica's load on a shared endpoint or its tenants' activity) or a heartbeat is due, appends one
  batch to the stream (`XADD ... MAXLEN ~ stream_max_len`): its full load report (and, once flow
  control shares its `Activity`, each active tenant's requests in flight, waiting and recent peak:
  what the slot reserve reads, and each active program's requests in flight and waiting: what the
  program slot reserve reads) and the block keys and session of every dispatch since the last batch;
- the reader blocks on `XREAD` from the last entry it saw, skips its own entries (by the entry's
  `r` field, before decoding: under load most entries a replica reads are its own), replaces each
  peer's load report, records their dispatches in the prefix index and session table, and drops
  peers silent for `ttl_s`.

Tool-boundary affinity rides the same batches (`tool_noted` / `tool_returned`: the router's
`ToolShare`, an append each): a program whose tool-call answer one replica served is noted on every
replica, with its age, so its next turn goes back to the holder whichever replica receives it; a
return dispatched anywhere ends the entry everywhere and teaches every replica's learner its gap.
Notes are applied live only (a replayed one's age is unknown); gaps replay too, as samples.

A starting replica first replays the stream's last `bootstrap_entries` entries (index and
sessions only: old load reports are stale by definition), so a fresh replica routes with the
fleet's memory rather than from nothing. If Redis is away, batches are dropped (counted), the
reader retries, and peers' loads expire: each replica falls back to its own view. Lost entries only
age out (LRU eviction of index keys, the next report of loads); nothing accumulates.

## The other replicas' load (`RemoteLoads`)

The other replicas' load, folded into each endpoint's `InFlight`.

Each replica's latest report replaces its previous one; a replica not heard from for `ttl_s`
(killed, partitioned from Redis) is dropped, and with it everything it reported: its requests
age out instead of staying on the books forever. Only endpoints this replica also knows, at the
same URL, are folded (ids are the same on every replica for static and discovered endpoints;
launched replicas are each gateway's own and are never shared).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from backends.fleet import Fleet
from backends.tasks import cancel_and_wait
from backends.types import Endpoint
from gateway.app.settings import ReplicasSettings
from gateway.replicas.wire import (
    Batch,
    Dispatch,
    Load,
    MalformedBatch,
    ProgramLoad,
    TenantLoad,
    ToolGap,
    ToolNote,
    decode,
    encode,
)
from policies.limits.scriptpipe import ScriptPipe, command, script_pipeline
from policies.routing.pipeline import ScoringRouter
from policies.routing.prefix_blocks import HashedPrompt
from policies.routing.types import RouteDecision


@dataclass(slots=True)
class Peer:
    seen_s: float
    sequence: int = -1
    loads: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    batches: int = 0
    gaps: int = 0  # batches it sent that this replica never read (trimmed or lost)


class RemoteLoads:
    def __init__(self, ttl_s: float, lookup: Callable[[str], Endpoint | None], max_peers: int = 1024) -> None:
        self.ttl_s = ttl_s
        self.lookup = lookup
        self.max_peers = max_peers
        self.peers: dict[str, Peer] = {}
        self.expired = 0

    def heard(self, replica: str, sequence: int, now_s: float) -> Peer:
        peer = self.peers.get(replica)
        if peer is None:
            if len(self.peers) >= self.max_peers:  # bounded: the stalest peer goes first
                self._drop(min(self.peers, key=lambda r: self.peers[r].seen_s))
            peer = self.peers[replica] = Peer(now_s)
        elif peer.sequence >= 0 and sequence > peer.sequence + 1:
            peer.gaps += sequence - peer.sequence - 1
        peer.seen_s = now_s
        peer.sequence = max(peer.sequence, sequence)
        peer.batches += 1
        return peer

    def report(self, replica: str, loads: Iterable[Load]) -> None:
        """Replace `replica`'s load report (it must have been `heard` first)."""
        peer = self.peers[replica]
        old = peer.loads
        peer.loads = {endpoint_id: (r, p, d) for endpoint_id, r, p, d in loads if r or p or d}
        self._refold(old.keys() | peer.loads.keys())

    def expire(self, now_s: float) -> list[str]:
        gone = [r for r, peer in self.peers.items() if now_s - peer.seen_s > self.ttl_s]
        for replica in gone:
            self._drop(replica)
        self.expired += len(gone)
        return gone

    def totals(self, endpoint_id: str) -> tuple[int, int, int]:
        r = p = d = 0
        for peer in self.peers.values():
            load = peer.loads.get(endpoint_id)
            if load is not None:
                r, p, d = r + load[0], p + load[1], d + load[2]
        return r, p, d

    def _drop(self, replica: str) -> None:
        peer = self.peers.pop(replica, None)
        if peer is not None:
            self._refold(peer.loads.keys())

    def _refold(self, endpoint_ids: Iterable[str]) -> None:
        for endpoint_id in endpoint_ids:
            endpoint = self.lookup(endpoint_id)
            if endpoint is not None:
                endpoint.inflight.set_remote(*self.totals(endpoint_id))


log = logging.getLogger("tokenway.replicas")

READ_COUNT = 1000
READ_BLOCK_MS = 1000
RETRY_S = 0.5


class SharedActivity(Protocol):
    """Per-tenant activity shared between replicas (`gateway.flow.activity.Activity`)."""

    def report(self) -> list[TenantLoad]: ...

    def set_remote(self, replica: str, rows: Iterable[TenantLoad]) -> None: ...

    def drop_remote(self, replica: str | None = None) -> None: ...


class SharedPrograms(Protocol):
    """Per-program activity shared between replicas (`gateway.flow.activity.ProgramActivity`)."""

    def report(self) -> list[ProgramLoad]: ...

    def set_remote(self, replica: str, rows: Iterable[ProgramLoad]) -> None: ...

    def drop_remote(self, replica: str | None = None) -> None: ...


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


class ReplicaBus:
    def __init__(
        self,
        settings: ReplicasSettings,
        redis_url: str,
        key_prefix: str,
        fleet: Fleet,
        router: ScoringRouter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.replica_id = settings.id or default_replica_id()
        self.stream = f"{key_prefix}:replicas"
        self._stream_key = self.stream.encode()
        self.fleet = fleet
        self.router = router
        self.clock = clock
        self.remote = RemoteLoads(settings.advanced.ttl_s, self._shared_endpoint)
        self.activity: SharedActivity | None = None  # flow control's, once its context has set it
        self.programs: SharedPrograms | None = None  # flow control's program activity, likewise
        self._redis_url = redis_url
        self._pending: deque[tuple[str, HashedPrompt, str | None]] = deque(
            maxlen=settings.advanced.max_pending_dispatches
        )
        # tool-boundary affinity: (tenant, program) -> (endpoint id, prefix tokens, noted at); gaps
        self._tool_notes: dict[tuple[str, str], tuple[str, int, float]] = {}
        self._tool_gaps: deque[ToolGap] = deque(maxlen=settings.advanced.max_pending_dispatches)
        self._own = self.replica_id.encode()
        self._writer: aioredis.Redis | None = None
        self._pipe: ScriptPipe | None = None  # the publisher's raw connection (plain TCP or unix socket)
        self._reader: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._shared: dict[str, Endpoint] = {}
        self._sequence = 0
        # counters for /admin/replicas
        self.batches_published = 0
        self.dispatches_published = 0
        self.dispatches_dropped = 0
        self.publish_errors = 0
        self.batches_read = 0
        self.dispatches_applied = 0
        self.malformed = 0
        self.read_errors = 0
        self.bootstrapped = 0
        self.tool_notes_applied = 0
        self.tool_gaps_applied = 0
        self.last_error: str | None = None

    # -- hot path ----------------------------------------------------------------------------------

    def dispatched(self, prompt: HashedPrompt, decision: RouteDecision, session: str | None) -> None:
        """The router's dispatch listener: one append, nothing else (keys are read at the flush)."""
        pending = self._pending
        if not decision.endpoint.launched:
            if len(pending) == pending.maxlen:
                self.dispatches_dropped += 1
            pending.append((decision.endpoint.id, prompt, session))
        prefill = decision.prefill_endpoint
        if prefill is not None and not prefill.launched:
            if len(pending) == pending.maxlen:
                self.dispatches_dropped += 1
            pending.append((prefill.id, prompt, None))

    def tool_noted(self, tenant: str, program: str, endpoint: Endpoint, prefix_tokens: int, now_s: float) -> None:
        """The router's `ToolShare`: an answer on a shared endpoint ended in tool calls (an append)."""
        if endpoint.launched:  # this process's own engine: no other replica routes there
            return
        notes = self._tool_notes
        notes.pop((tenant, program), None)
        if len(notes) >= self.settings.advanced.max_pending_dispatches:
            del notes[next(iter(notes))]  # the oldest waiting
        notes[(tenant, program)] = (endpoint.id, max(int(prefix_tokens), 0), now_s)

    def tool_returned(self, tenant: str, program: str, gap_s: float) -> None:
        """The router's `ToolShare`: a program came back `gap_s` after its tool-call answer (an append).
        A note of it still waiting is dropped: it is over, and so a batch's gaps all precede its notes."""
        self._tool_notes.pop((tenant, program), None)
        self._tool_gaps.append((tenant, program, max(int(gap_s * 1000.0), 0)))

    def _take_tools(self, now_s: float) -> tuple[list[ToolNote], list[ToolGap]]:
        notes = [
            (tenant, program, endpoint_id, tokens, max(int((now_s - noted_s) * 1000.0), 0))
            for (tenant, program), (endpoint_id, tokens, noted_s) in self._tool_notes.items()
        ]
        gaps = list(self._tool_gaps)
        self._tool_notes.clear()
        self._tool_gaps.clear()
        return notes, gaps

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._writer = aioredis.Redis.from_url(self._redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        pipe = script_pipeline(self._writer, ())
        self._pipe = pipe if isinstance(pipe, ScriptPipe) else None
        self._reader = aioredis.Redis.from_url(
            self._redis_url, socket_timeout=READ_BLOCK_MS / 1000 + 5.0, socket_connect_timeout=2.0
        )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._publish_loop(), name="replicas publish"),
            loop.create_task(self._read_loop(), name="replicas read"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, what="replicas bus")
        self._tasks = []
        if self._pipe is not None:
            with contextlib.suppress(Exception):
                await self._pipe.close()
        for client in (self._writer, self._reader):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
        # what this replica believed of the others goes with it
        for endpoint_id in list(self._shared):
            endpoint = self._shared.get(endpoint_id)
            if endpoint is not None:
                endpoint.inflight.set_remote(0, 0, 0)
        if self.activity is not None:
            self.activity.drop_remote()
        if self.programs is not None:
            self.programs.drop_remote()

    # -- publishing --------------------------------------------------------------------------------

    def _refresh_shared(self) -> dict[str, Endpoint]:
        self._shared = {e.id: e for e in self.fleet.endpoints() if not e.launched}
        return self._shared

    def _shared_endpoint(self, endpoint_id: str) -> Endpoint | None:
        endpoint = self._shared.get(endpoint_id)
        if endpoint is None:
            endpoint = self._refresh_shared().get(endpoint_id)
        return endpoint

    def _local_loads(self) -> list[Load]:
        loads = []
        for endpoint_id, endpoint in sorted(self._refresh_shared().items()):
            requests, prefill, decode_tokens = endpoint.inflight.local()
            if requests or prefill or decode_tokens:
                loads.append((endpoint_id, max(requests, 0), max(prefill, 0), max(decode_tokens, 0)))
        return loads

    def _take_dispatches(self) -> list[Dispatch]:
        taken: list[Dispatch] = []
        index = self.router.index
        limit = self.settings.advanced.max_keys_per_dispatch
        pending = self._pending
        while pending:
            endpoint_id, prompt, session = pending.popleft()
            taken.append((endpoint_id, index.dispatched_keys(prompt)[:limit], session))
        return taken

    async def _publish_loop(self) -> None:
        interval_s = self.settings.advanced.publish_interval_ms / 1000.0
        reported: list[Load] | None = None
        reported_tenants: list[TenantLoad] | None = None
        reported_programs: list[ProgramLoad] | None = None
        reported_at_s = float("-inf")
        while True:
            await asyncio.sleep(interval_s)
            now_s = self.clock()
            loads = self._local_loads()
            tenants = self.activity.report() if self.activity is not None else None
            programs = self.programs.report() if self.programs is not None else None
            report = (
                loads != reported
                or tenants != reported_tenants
                or programs != reported_programs
                or now_s - reported_at_s >= self.settings.advanced.heartbeat_s
            )
            dispatches = self._take_dispatches()
            notes, gaps = self._take_tools(now_s)
            if not report and not dispatches and not notes and not gaps:
                continue
            batch = Batch(
                self.replica_id,
                self._sequence,
                loads if report else None,
                dispatches,
                tenants if report else None,
                notes,
                gaps,
                programs=programs if report else None,
            )
            try:
                await self._xadd(encode(batch))
            except (RedisError, OSError) as exc:
                self.publish_errors += 1
                self.dispatches_dropped += len(dispatches)
                self._note_error(f"publish: {exc}")
                if isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE"):
                    await self._replace_stream()
                continue
            self._sequence += 1
            self.batches_published += 1
            self.dispatches_published += len(dispatches)
            if report:
                reported, reported_tenants, reported_at_s = loads, tenants, now_s
                reported_programs = programs

    async def _xadd(self, payload: bytes) -> None:
        """One entry: over the raw pipe (the command encoded here, no redis-py per batch: under load
        a batch goes out every `publish_interval_ms`), else through redis-py (TLS, unusual clients)."""
        if self._pipe is not None:
            maxlen = str(self.settings.advanced.stream_max_len).encode()
            words = (b"XADD", self._stream_key, b"MAXLEN", b"~", maxlen, b"*", b"r", self._own, b"b", payload)
            await self._pipe.submit(command(*words), None)
            return
        assert self._writer is not None
        await self._writer.xadd(
            self.stream, {"r": self._own, "b": payload}, maxlen=self.settings.advanced.stream_max_len, approximate=True
        )

    async def _replace_stream(self) -> None:
        """The stream's key holds another type (nothing of ours writes one there: a hand edit, another
        program on the prefix): it is deleted, so the next batch starts the stream afresh rather than
        every replica failing to publish and read until an operator repairs it. What it held is lost,
        as entries trimmed by `MAXLEN` are: peers' loads come back with their next report."""
        with contextlib.suppress(RedisError, OSError):
            assert self._writer is not None
            if (await self._writer.type(self.stream)) not in (b"stream", b"none", "stream", "none"):
                await self._writer.delete(self.stream)

    # -- reading -----------------------------------------------------------------------------------

    async def _bootstrap(self) -> str:
        """Replay the stream's recent dispatches; the id to read on from."""
        assert self._reader is not None
        if self.settings.advanced.bootstrap_entries == 0:
            return "$"
        try:
            entries: Any = await self._reader.xrevrange(self.stream, count=self.settings.advanced.bootstrap_entries)
        except (RedisError, OSError) as exc:
            self._note_error(f"bootstrap: {exc}")
            return "$"
        self._refresh_shared()
        for _entry_id, fields in reversed(entries):
            if self._apply(fields, self.clock(), live=False):
                self.bootstrapped += 1
        return _text(entries[0][0]) if entries else "0-0"

    async def _read_loop(self) -> None:
        last_id = await self._bootstrap()
        while True:
            try:
                assert self._reader is not None
                response: Any = await self._reader.xread({self.stream: last_id}, count=READ_COUNT, block=READ_BLOCK_MS)
            except (RedisError, OSError) as exc:
                self.read_errors += 1
                self._note_error(f"read: {exc}")
                self._expire(self.clock())
                await asyncio.sleep(RETRY_S)
                continue
            now_s = self.clock()
            for _stream, entries in response or []:
                for entry_id, fields in entries:
                    last_id = _text(entry_id)
                    try:
                        self._apply(fields, now_s, live=True)
                    except Exception:  # a bug on one entry must not end this replica's reading
                        self.malformed += 1
                        log.exception("replicas: an entry failed to apply")
            self._expire(now_s)

    def _expire(self, now_s: float) -> None:
        for replica in self.remote.expire(now_s):
            if self.activity is not None:
                self.activity.drop_remote(replica)
            if self.programs is not None:
                self.programs.drop_remote(replica)

    def _apply(self, fields: Any, now_s: float, *, live: bool) -> bool:
        if not isinstance(fields, dict):
            self.malformed += 1
            return False
        if fields.get(b"r") == self._own:
            return False  # ours: nothing to learn, and not worth decoding
        data = fields.get(b"b", fields.get("b"))
        if not isinstance(data, bytes):
            self.malformed += 1
            return False
        try:
            batch = decode(data)
        except MalformedBatch:
            self.malformed += 1
            return False
        if batch.replica == self.replica_id:
            return False
        if live:
            self.batches_read += 1
            self.remote.heard(batch.replica, batch.sequence, now_s)
            if batch.loads is not None:
                self.remote.report(batch.replica, batch.loads)
            if batch.tenants is not None and self.activity is not None:
                self.activity.set_remote(batch.replica, batch.tenants)
            if batch.programs is not None and self.programs is not None:
                self.programs.set_remote(batch.replica, batch.programs)
        for endpoint_id, keys, session in batch.dispatches:
            endpoint = self._shared_endpoint(endpoint_id)
            if endpoint is not None:
                self.router.on_remote_dispatch(endpoint, keys, session)
                self.dispatches_applied += 1
        for tenant, program, gap_ms in batch.tool_gaps:  # first: a batch's notes all follow its returns
            self.router.on_remote_return(tenant, program, gap_ms / 1000.0)
            self.tool_gaps_applied += 1
        for tenant, program, endpoint_id, tokens, age_ms in batch.tool_notes if live else ():
            endpoint = self._shared_endpoint(endpoint_id)
            if endpoint is not None:
                self.router.on_remote_tool_call(tenant, program, endpoint, tokens, now_s - age_ms / 1000.0)
                self.tool_notes_applied += 1
        return True

    def _note_error(self, message: str) -> None:
        if message != self.last_error:
            log.warning("replicas: %s", message)
        self.last_error = message

    # -- reporting ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now_s = self.clock()
        return {
            "replica": self.replica_id,
            "stream": self.stream,
            "batches_published": self.batches_published,
            "dispatches_published": self.dispatches_published,
            "dispatches_dropped": self.dispatches_dropped,
            "publish_errors": self.publish_errors,
            "batches_read": self.batches_read,
            "dispatches_applied": self.dispatches_applied,
            "tool_notes_applied": self.tool_notes_applied,
            "tool_gaps_applied": self.tool_gaps_applied,
            "bootstrapped_entries": self.bootstrapped,
            "malformed": self.malformed,
            "read_errors": self.read_errors,
            "expired_peers": self.remote.expired,
            "last_error": self.last_error,
            "peers": {
                replica: {
                    "age_s": round(now_s - peer.seen_s, 3),
                    "sequence": peer.sequence,
                    "batches": peer.batches,
                    "gaps": peer.gaps,
                    "endpoints_loaded": len(peer.loads),
                    "requests": sum(load[0] for load in peer.loads.values()),
                }
                for replica, peer in self.remote.peers.items()
            },
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

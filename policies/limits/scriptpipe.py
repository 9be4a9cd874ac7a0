"""The limiter's scripts on the wire: RESP bytes encoded once per plan, one raw pipelined connection
(`ScriptPipe`), or redis-py's pipeline (`AutoPipeline`) for other clients.

Both carry the calls of one event-loop turn in one write and reload the scripts after a NOSCRIPT;
`script_pipeline` picks one for a client.

Script calls as RESP bytes
--------------------------

Script calls as RESP bytes: the parts of an EVALSHA that do not change between requests (the
script's digest, the key names, a plan's fixed parameters) are encoded once, so a request encodes
only its ticket id and numbers.

The raw pipelined connection
----------------------------

The limiter's scripts over one raw, pipelined Redis connection: commands pre-encoded by the caller,
replies parsed by hiredis, no client library in between.

Profiled under load, the limiter's Redis calls cost more in redis-py than anywhere else: a
connection taken from and returned to the pool, a pipeline object, each command's arguments packed
one by one, a task per batch, the reply run through response callbacks. This connection keeps only
what the two scripts need. Callers hand it a complete RESP command (`EvalSha` caches the parts
that do not change between requests, so a request encodes only its ticket id and numbers); `call`
appends it to the next write, returns a future, and the write goes out once at the end of the
event-loop turn, so the calls of one turn still share one write (as `AutoPipeline` did). A lazy
command (a settlement: nobody waits for its reply) does not ask for a write of its own: it goes out
with the next reservation, or alone after a millisecond, so under load settlements cost no write
and no wake-up of their own, and order is kept (what this process sends later runs after them). Replies
come back in order on the one connection and go to their callers' futures in order; a reply of a
caller that gave up is dropped.

Failures are what redis-py's would be (the breaker and fail-open logic above cannot tell): the
oldest unanswered command older than `timeout_s` ends the connection with a `TimeoutError` for every
command on it (a late reply can never reach the wrong caller: the connection that would carry it is
gone; the deadline is checked again after the socket was read, so a stall of this process alone,
with the replies already waiting in the socket, is not taken for a slow Redis), a lost connection
fails its commands with `ConnectionError`, the next call reconnects. A NOSCRIPT reply (Redis
restarted, failed over, or SCRIPT FLUSH) loads every script on the same connection and sends the
command again, once.

Plain TCP and unix sockets only: a TLS or otherwise unusual client keeps `AutoPipeline`
(`script_pipeline` picks).

redis-py's pipeline
-------------------

Script calls that arrive in the same event-loop turn go to Redis as one pipeline.

Under load a gateway has many requests in flight; sending each EVALSHA as its own write costs a
syscall and a wake-up of Redis per request, which is most of the limiter's cost. A call queues its
command; the first call of a turn schedules a flush at the end of that turn, which sends everything
queued in one write (as its own task, so a cancelled caller cannot strand the others) and hands each
caller its reply. A request still makes exactly one round trip; a lone command goes out as a plain
EVALSHA. Batches in flight overlap (each takes its own pooled connection). Measured on this 2-vCPU
VM: 64 requests in flight from one loop reach about twice the admissions per second of one EVALSHA per
request, and a lone request pays no measurable extra (bench/results/limiter.md).

A flushed script cache (NOSCRIPT) is handled here: load the scripts, resend what failed, once.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import deque
from collections.abc import Sequence
from importlib import resources
from typing import Any, cast

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


class Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()


def load_script(package: str, name: str) -> Script:
    """The Lua script `name` shipped in `package`, behind the helpers every script shares
    (policies/limits/preamble.lua): one definition of the clock, the number format, a bucket's drain
    and the budget period, instead of a copy in each script."""
    preamble = resources.files("policies.limits").joinpath("preamble.lua").read_text(encoding="utf-8")
    return Script(preamble + resources.files(package).joinpath(name).read_text(encoding="utf-8"))


def stored_number(value: Any) -> float | None:
    """A number as Redis returned it, or None where it holds what no replica writes (text, NaN, an
    infinity): a shared store is input (another version, a hand edit, a restore), and the Python
    readers of its counters, sums and times take it through here, as the scripts take `num`
    (policies/limits/preamble.lua)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def command(*words: bytes) -> bytes:
    return b"*%d\r\n" % len(words) + b"".join(map(bulk, words))


class Pre:
    """A script argument encoded once (a plan's fixed parameters); `value` for clients that encode."""

    __slots__ = ("resp", "value")

    def __init__(self, value: str) -> None:
        self.value = value
        self.resp = bulk(value.encode())


Arg = str | Pre


class EvalSha:
    """An EVALSHA of `script` over fixed `keys` with `nargs` arguments, its head encoded once."""

    __slots__ = ("head", "keys", "nargs", "script")

    def __init__(self, script: Script, keys: Sequence[str], nargs: int) -> None:
        self.script = script
        self.keys = tuple(keys)
        self.nargs = nargs
        head = [b"*%d\r\n" % (3 + len(keys) + nargs), bulk(b"EVALSHA"), bulk(script.sha.encode())]
        head.append(bulk(str(len(keys)).encode()))
        head += [bulk(key.encode()) for key in keys]
        self.head = b"".join(head)

    def encode(self, args: Sequence[Arg]) -> bytes:
        assert len(args) == self.nargs
        parts = [a.resp if isinstance(a, Pre) else bulk(a.encode()) for a in args]
        return self.head + b"".join(parts)

    @staticmethod
    def values(args: Sequence[Arg]) -> list[str]:
        return [a.value if isinstance(a, Pre) else a for a in args]


__all__ = ["AutoPipeline", "Script"]

MAX_BATCH = 512

_Call = tuple[Script, Sequence[Any], Sequence[Any], "asyncio.Future[Any] | None"]
_NO_FUTURE = None


class AutoPipeline:
    def __init__(self, client: Redis, scripts: Sequence[Script], *, batch: bool = True) -> None:
        self.client = client
        self.batch = batch  # False: one write per call (the benchmark's baseline)
        self.scripts = tuple(scripts)
        self._queue: list[_Call] = []
        self._scheduled = False
        self._sending: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.calls = 0

    async def call(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        if not self.batch:
            (result,) = await self._execute([(script, keys, args, _NO_FUTURE)])
            if isinstance(result, NoScriptError):
                await self._load_scripts()
                (result,) = await self._execute([(script, keys, args, _NO_FUTURE)])
            if isinstance(result, Exception):
                raise result
            return result
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((script, keys, args, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return await future

    async def send(self, evalsha: EvalSha, args: Sequence[Arg], *, lazy: bool = False) -> Any:
        """`call` with a pre-encoded command (`lazy`: `ScriptPipe`'s hint, no difference here)."""
        return await self.call(evalsha.script, evalsha.keys, evalsha.values(args))

    def _flush(self) -> None:
        self._scheduled = False
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            task = loop.create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[_Call]) -> None:
        self.batches += 1
        self.calls += len(batch)
        try:
            results = await self._execute(batch)
            if any(isinstance(r, NoScriptError) for r in results):
                await self._load_scripts()
                retry = [call for call, r in zip(batch, results, strict=True) if isinstance(r, NoScriptError)]
                redone = iter(await self._execute(retry))
                results = [next(redone) if isinstance(r, NoScriptError) else r for r in results]
        except Exception as exc:  # the connection failed: every caller of the batch sees it
            for *_, future in batch:
                if future is not None and not future.done():
                    future.set_exception(exc)
            return
        for (*_, future), result in zip(batch, results, strict=True):
            if future is None or future.done():  # its caller was cancelled
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _execute(self, batch: list[_Call]) -> list[Any]:
        if len(batch) == 1:
            script, keys, args, _ = batch[0]
            try:
                return [await self.client.evalsha(script.sha, len(keys), *keys, *args)]
            except NoScriptError as exc:
                return [exc]
        pipe = self.client.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        return list(await pipe.execute(raise_on_error=False))

    async def _load_scripts(self) -> None:
        for script in self.scripts:
            await self.client.script_load(script.source)


MAX_WRITE = 512  # commands per write (a burst beyond it goes out in several)
LAZY_S = 0.001  # the longest a lazy command waits for company before it is written alone


class _Protocol(asyncio.Protocol):
    def __init__(self, pipe: ScriptPipe) -> None:
        self.pipe = pipe
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # for close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not subclasses)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        on_reply = self.pipe._on_reply
        while True:
            reply = reader.gets()
            if reply is False:
                return
            on_reply(self, reply)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.pipe._lost(self, RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}"))


# A command on its way: (future or None for the pipe's own, command bytes, script, tries, deadline)
_Entry = list[Any]


class ScriptPipe:
    """`AutoPipeline`'s interface (`call`, `batches`, `calls`) plus `send(EvalSha, args)` for
    pre-encoded commands, over one connection of its own."""

    def __init__(
        self,
        client: Redis,
        scripts: Sequence[Script],
        *,
        batch: bool = True,
        timeout_s: float | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        self.client = client
        self.scripts = tuple(scripts)
        self.batch = batch
        kwargs = client.connection_pool.connection_kwargs
        self._path: str | None = kwargs.get("path")
        self._host: str = kwargs.get("host", "localhost")
        self._port: int = int(kwargs.get("port", 6379))
        self._timeout_s = timeout_s if timeout_s is not None else kwargs.get("socket_timeout") or 5.0
        self._connect_timeout_s = connect_timeout_s or kwargs.get("socket_connect_timeout") or self._timeout_s
        hello: list[bytes] = []
        password, username, db = kwargs.get("password"), kwargs.get("username"), int(kwargs.get("db") or 0)
        if password:
            hello.append(command(b"AUTH", *([username.encode()] if username else []), str(password).encode()))
        if db:
            hello.append(command(b"SELECT", str(db).encode()))
        self._hello = hello
        self._loads = [command(b"SCRIPT", b"LOAD", s.source.encode()) for s in self.scripts]
        self._proto: _Protocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._inflight: deque[_Entry] = deque()  # written (or in `_out`) on `_proto`, in order
        self._waiting: list[_Entry] = []  # no connection yet
        self._out: list[bytes] = []
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._lazy: asyncio.TimerHandle | None = None  # the write of lazy commands, if none comes sooner
        self._closed = False
        self.batches = 0  # writes of the batching mode
        self.calls = 0
        self.reconnects = 0
        self.script_loads = 0

    # ------------------------------------------------------------------ calls
    async def call(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """`AutoPipeline.call`: the whole command encoded here (the store's calls use `send`)."""
        words = [b"EVALSHA", script.sha.encode(), str(len(keys)).encode()]
        words += [_word(k) for k in keys]
        words += [_word(a) for a in args]
        return await self.submit(command(*words), script)

    def send(self, evalsha: EvalSha, args: Sequence[Arg], *, lazy: bool = False) -> asyncio.Future[Any]:
        return self.submit(evalsha.encode(args), evalsha.script, lazy=lazy)

    def submit(self, data: bytes, script: Script | None, *, lazy: bool = False) -> asyncio.Future[Any]:
        """Queue one encoded command; its reply (or error) resolves the future. `lazy` (a settlement,
        which nobody waits for): it goes out with the next command that is not, or after `LAZY_S`."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.calls += 1
        entry: _Entry = [future, data, script, 0, 0.0]
        if self._closed:
            future.set_exception(RedisConnectionError("the limiter's Redis connection is closed"))
            return future
        if self._proto is None or self._loop is not loop:
            self._waiting.append(entry)
            self._connect(loop)
            return future
        self._push(entry, loop, lazy)
        return future

    def _push(self, entry: _Entry, loop: asyncio.AbstractEventLoop, lazy: bool = False) -> None:
        entry[4] = loop.time() + self._timeout_s
        self._inflight.append(entry)
        self._out.append(entry[1])
        if self._timer is None:
            self._timer = loop.call_at(entry[4], self._check_timeout)
        if not self.batch:
            self._write()
        elif self._scheduled:
            return
        elif not lazy:
            self._scheduled = True
            loop.call_soon(self._write)
        elif self._lazy is None:
            self._lazy = loop.call_later(LAZY_S, self._write)

    def _write(self) -> None:
        self._scheduled = False
        if self._lazy is not None:
            self._lazy.cancel()
            self._lazy = None
        out, self._out = self._out, []
        if not out or self._proto is None or self._proto.transport is None:
            return
        transport = self._proto.transport
        for i in range(0, len(out), MAX_WRITE):
            self.batches += self.batch  # (one write per command when not batching: not a batch)
            transport.write(b"".join(out[i : i + MAX_WRITE]))

    # ------------------------------------------------------------------ replies
    def _on_reply(self, proto: _Protocol, reply: Any) -> None:
        if proto is not self._proto or not self._inflight:
            return
        entry = self._inflight.popleft()
        future = entry[0]
        if isinstance(reply, ResponseError):
            if str(reply).startswith("NOSCRIPT") and entry[2] is not None and entry[3] == 0:
                self._reload_and_resend(entry)
                return
            if str(reply).startswith("NOSCRIPT"):
                reply = NoScriptError(str(reply))
            if future is not None and not future.done():
                future.set_exception(reply)
            elif future is None:  # one of ours (AUTH, SELECT, SCRIPT LOAD) failed: start afresh
                self._fail(proto, reply)
            return
        if future is not None and not future.done():
            future.set_result(reply)

    def _reload_and_resend(self, entry: _Entry) -> None:
        """The scripts are gone from Redis: load them, then send the command again (it runs after the
        load on the same connection). Commands already behind it find the scripts loaded when resent."""
        loop = self._loop
        assert loop is not None
        if not self._loading_ahead():
            self.script_loads += 1
            for load in self._loads:
                self._push([None, load, None, 1, 0.0], loop)
        entry[3] = 1
        self._push(entry, loop)

    def _loading_ahead(self) -> bool:
        """A SCRIPT LOAD is already queued behind the reply being handled."""
        return any(e[0] is None and e[1] in self._loads for e in self._inflight)

    def _check_timeout(self, confirmed: bool = False) -> None:
        self._timer = None
        if not self._inflight or self._proto is None or self._loop is None:
            return
        head_deadline = self._inflight[0][4]
        now = self._loop.time()
        if now < head_deadline:
            self._timer = self._loop.call_at(head_deadline, self._check_timeout)
            return
        if not confirmed:  # after a stall of this process the reply may be in the socket already: read first
            self._timer = self._loop.call_later(0, self._check_timeout, True)
            return
        where = self._path or f"{self._host}:{self._port}"
        self._fail(self._proto, RedisTimeoutError(f"Timeout reading from {where}"))

    # ------------------------------------------------------------------ connection
    def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop:  # first use, or a new event loop (tests): the old one is gone
            self._proto, self._loop, self._connecting, self._timer, self._lazy = None, loop, None, None, None
            self._scheduled = False
            self._inflight.clear()
            self._out = []
            self._waiting = [e for e in self._waiting if e[0].get_loop() is loop]
        if self._connecting is None or self._connecting.done():
            self._connecting = loop.create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        where = self._path or f"{self._host}:{self._port}"
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if self._path is not None:
                    _, proto = await loop.create_unix_connection(lambda: _Protocol(self), self._path)
                else:
                    _, proto = await loop.create_connection(lambda: _Protocol(self), self._host, self._port)
        except OSError as exc:  # TimeoutError among them
            error: Exception = (
                RedisTimeoutError(f"Timeout connecting to {where}")
                if isinstance(exc, TimeoutError)
                else RedisConnectionError(f"Error connecting to {where}: {exc}")
            )
            waiting, self._waiting = self._waiting, []
            for entry in waiting:
                if not entry[0].done():
                    entry[0].set_exception(error)
            return
        if self._closed or self._loop is not loop:
            assert proto.transport is not None
            proto.transport.close()
            return
        self.reconnects += 1
        self._proto = proto
        for hello in self._hello:  # AUTH, SELECT first: an error reply ends the connection and all behind it
            self._push([None, hello, None, 1, 0.0], loop)
        waiting, self._waiting = self._waiting, []
        for entry in waiting:
            if not entry[0].done():
                self._push(entry, loop)

    def _lost(self, proto: _Protocol, error: Exception) -> None:
        if proto is self._proto:
            self._fail(proto, error)

    def _fail(self, proto: _Protocol, error: Exception) -> None:
        """End `proto` and every command on it with `error` (the next call reconnects)."""
        if proto is self._proto:
            self._proto = None
            inflight, self._inflight = self._inflight, deque()
            self._out = []
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for entry in inflight:
                future = entry[0]
                if future is not None and not future.done():
                    future.set_exception(error)
        if proto.transport is not None and not proto.transport.is_closing():
            proto.transport.close()

    async def close(self) -> None:
        self._closed = True
        error = RedisConnectionError("the limiter's Redis connection is closed")
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        waiting, self._waiting = self._waiting, []
        for entry in waiting:  # their connection will never open
            if not entry[0].done():
                entry[0].set_exception(error)
        proto = self._proto
        if proto is not None:
            self._fail(proto, error)
            await asyncio.wait({proto.lost}, timeout=1.0)


def script_pipeline(client: Redis, scripts: Sequence[Script], *, batch: bool = True) -> ScriptPipe | AutoPipeline:
    """The raw pipe for a plain TCP or unix-socket client, else redis-py's own path."""
    pool = client.connection_pool
    if pool.connection_class in (Connection, UnixDomainSocketConnection):
        return ScriptPipe(client, scripts, batch=batch)
    return AutoPipeline(client, scripts, batch=batch)


def _word(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    return (repr(value) if isinstance(value, float) else str(value)).encode()

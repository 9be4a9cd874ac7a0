"""The batch store in Redis (`state: redis`): every gateway replica sees every file and batch, and
each replica's runner claims lines, so two replicas never run the same line at once.

Every key is under one hash tag, `{<prefix>:batch}` (one Redis Cluster slot; batch metadata is
small, its files are strings read by range):

    :seq                          creation order of files and batches
    :file:<id>  :file:<id>:data  :file:<id>:idx      record (JSON), bytes, request spans
    :owner:<key>:files  :owner:<key>:batches           the key's ids by creation order
    :tenant:<t>:usage  :tenant:<t>:batches             storage used; the tenant's batches
    :active                                            batches not finished
    :batch:<id>                                        record (JSON; status changes compare-and-set)
    :batch:<id>:cursor                                 the next line never handed out
    :batch:<id>:lease   (zset line -> deadline ms)     claimed, not recorded
    :batch:<id>:retry   (zset line -> due ms)          deferred
    :batch:<id>:res     (hash line -> record)          results, written once (HSETNX)
    :batch:<id>:counts                                 completed / failed / token sums

A claim (one Lua call, Redis's own clock) takes, in order: lines whose claimant's lease ran out
without a result (a replica died or stalled), deferred lines now due, then fresh lines from the
cursor. Claimants renew their leases while the lines run. `record` writes a result with HSETNX, so
when a stalled replica and the one that took its line over both finish, only the first answer is
kept. Durability is Redis's: run it with `appendonly yes` (`appendfsync everysec` can lose the last
second of results, whose lines then run again).

What Redis holds is read as input (another replica's version, a hand edit, a restore can leave
anything under the prefix; `bench/chaos/state_fuzz.py`): a record that is not one
(`read_file_meta`, `read_batch_meta`, a result that does not parse) reads as absent, a key of another
type than the one written there reads as empty and is replaced by the next write, and a count that is
no number restarts. So one damaged key costs that file or batch its state, never a listing, an upload
or a runner.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator, Awaitable, Collection, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import orjson
import redis.asyncio as aioredis
from redis.exceptions import ResponseError, WatchError

from gateway.batch.objects import FINISHED, BatchMeta, Counts, FileMeta, read_batch_meta, read_file_meta
from gateway.batch.store import LineResult, QuotaExceeded
from policies.limits.scriptpipe import stored_number

_CHUNK: Final = 1 << 20
_READ_BATCH: Final = 500

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# Before a script uses its keys: each KEYS[k] whose type is not `types[k]` (a key of another type:
# written by something else) is deleted, so the script runs on an empty key; `count` reads a stored
# count that is none (text, NaN, an infinity, past 2^53) as 0, and a fraction as its floor.
_TYPED = """
local function typed(types)
  for k, want in ipairs(types) do
    local t = redis.call('TYPE', KEYS[k]).ok
    if t ~= want and t ~= 'none' then redis.call('DEL', KEYS[k]) end
  end
end
local function count(v)
  local x = tonumber(v)
  if x == nil or x ~= x or x > 9007199254740992 or x < -9007199254740992 then return 0 end
  return math.floor(x)
end
"""

_CLAIM = (
    _NOW
    + _TYPED
    + """
typed({'string', 'zset', 'zset', 'hash'})
local n = tonumber(ARGV[1]); local deadline = now + tonumber(ARGV[2]); local total = tonumber(ARGV[3])
local out = {}
-- a lease or a deferral names a line: a member that is none (written by something else) is dropped
local function line(i) return string.match(i, '^%d+$') and string.len(i) < 10 and tonumber(i) < total end
for _, i in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, n)) do
  if not line(i) or redis.call('HEXISTS', KEYS[4], i) == 1 then redis.call('ZREM', KEYS[2], i)
  else redis.call('ZADD', KEYS[2], deadline, i); out[#out + 1] = i end
end
if #out < n then
  for _, i in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, n - #out)) do
    redis.call('ZREM', KEYS[3], i)
    if line(i) and redis.call('HEXISTS', KEYS[4], i) == 0 then
      redis.call('ZADD', KEYS[2], deadline, i); out[#out + 1] = i
    end
  end
end
while #out < n do
  local c = math.max(math.floor(count(redis.call('GET', KEYS[1]))), 0)
  if c >= total then break end
  redis.call('SET', KEYS[1], c + 1)
  local i = tostring(c)
  if redis.call('HEXISTS', KEYS[4], i) == 0 then redis.call('ZADD', KEYS[2], deadline, i); out[#out + 1] = i end
end
return out
"""
)

_RENEW = (
    _NOW
    + _TYPED
    + """
typed({'zset'})
local deadline = now + tonumber(ARGV[1])
for k = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[k]) end
return 0
"""
)

_DEFER = (
    _NOW
    + _TYPED
    + """
typed({'zset', 'zset', 'hash'})
local due = now + tonumber(ARGV[1])
for k = 2, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[k]) == 1 and redis.call('HEXISTS', KEYS[3], ARGV[k]) == 0 then
    redis.call('ZADD', KEYS[2], due, ARGV[k])
  end
end
return 0
"""
)

_RECORD = (
    _TYPED
    + """
typed({'hash', 'zset', 'hash'})
-- a count that is no integer (written by something else) restarts from this result's
local function add(field, by)
  local r = redis.pcall('HINCRBY', KEYS[3], field, by)
  if type(r) == 'table' and r.err then redis.call('HSET', KEYS[3], field, by) end
end
local out = {}
for k = 1, #ARGV, 6 do
  local i = ARGV[k]
  redis.call('ZREM', KEYS[2], i)
  if redis.call('HSETNX', KEYS[1], i, ARGV[k + 1]) == 1 then
    add(ARGV[k + 2], 1)
    add('input', ARGV[k + 3])
    add('cached', ARGV[k + 4])
    add('output', ARGV[k + 5])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
)

_HELD = _NOW + _TYPED + "typed({'zset'})\nreturn redis.call('ZCOUNT', KEYS[1], now, '+inf')\n"

# A tenant's files and bytes (a count that is no number, or a key of another type, restarts at 0:
# the quota then counts from what is stored next).
_RESERVE = (
    _TYPED
    + """
typed({'hash'})
local files = math.max(count(redis.call('HGET', KEYS[1], 'files')), 0)
local used = math.max(count(redis.call('HGET', KEYS[1], 'bytes')), 0)
if tostring(files) ~= redis.call('HGET', KEYS[1], 'files') then redis.call('HSET', KEYS[1], 'files', files) end
if tostring(used) ~= redis.call('HGET', KEYS[1], 'bytes') then redis.call('HSET', KEYS[1], 'bytes', used) end
local add = tonumber(ARGV[1]); local max_files = tonumber(ARGV[2]); local max_bytes = tonumber(ARGV[3])
if max_files > 0 and (files + 1 > max_files or used + add > max_bytes) then return {0, files, used} end
redis.call('HINCRBY', KEYS[1], 'files', 1)
redis.call('HINCRBY', KEYS[1], 'bytes', add)
return {1, files, used}
"""
)

# Before a write that spans several keys (a MULTI): each KEYS[k] whose type is not ARGV[k] is deleted.
_FIX = """
for k = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[k]).ok
  if t ~= ARGV[k] and t ~= 'none' then redis.call('DEL', KEYS[k]) end
end
return 0
"""

# A file's share of its tenant's quota given back, never below 0 (what `_RESERVE` took).
_GIVE_BACK = (
    _TYPED
    + """
typed({'hash'})
redis.call('HSET', KEYS[1], 'files', math.max(count(redis.call('HGET', KEYS[1], 'files')) - 1, 0))
redis.call('HSET', KEYS[1], 'bytes', math.max(count(redis.call('HGET', KEYS[1], 'bytes')) - tonumber(ARGV[1]), 0))
return 0
"""
)

# The next creation number: INCR, or where the counter holds no integer, one past the time in ms (the
# counter orders listings: every earlier number is smaller than any time).
_SEQ = (
    _NOW
    + """
local r = redis.pcall('INCR', KEYS[1])
if type(r) == 'table' and r.err then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[1], now)
  return now
end
return r
"""
)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _integer(value: Any) -> int:
    """A count Redis holds, 0 where it is none (text, NaN)."""
    return int(stored_number(value) or 0)


T = TypeVar("T")


async def _or_empty(call: Awaitable[T], empty: T) -> T:
    """`call`, or `empty` where Redis refuses it for a key of another type (written by something else)."""
    try:
        return await call
    except ResponseError as exc:
        if "WRONGTYPE" not in str(exc):
            raise
        return empty


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class RedisBatchStore:
    def __init__(self, client: aioredis.Redis, prefix: str, scratch: Path) -> None:
        self.client = client
        self.p = f"{{{prefix}:batch}}"
        self._scratch = scratch
        scratch.mkdir(parents=True, exist_ok=True)
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._defer = client.register_script(_DEFER)
        self._record = client.register_script(_RECORD)
        self._held = client.register_script(_HELD)
        self._reserve = client.register_script(_RESERVE)
        self._seq = client.register_script(_SEQ)
        self._fix_types = client.register_script(_FIX)
        self._give_back = client.register_script(_GIVE_BACK)

    @classmethod
    def from_url(cls, url: str, prefix: str, scratch: Path) -> RedisBatchStore:
        return cls(aioredis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=2.0), prefix, scratch)

    def scratch(self) -> Path:
        return self._scratch

    async def lock(self, name: str, ttl_s: float) -> bool:
        return bool(await self.client.set(self._k("lock", name), b"1", nx=True, px=int(ttl_s * 1000)))

    async def unlock(self, name: str) -> None:
        await self.client.delete(self._k("lock", name))

    def _k(self, *parts: str) -> str:
        return ":".join((self.p, *parts))

    async def _typed(self, keys: dict[str, str]) -> None:
        """Keys a MULTI is about to write, by the type each must have: one of another type (written by
        something else) is deleted first, so the MULTI does not fail on it."""
        names = list(keys)
        await self._fix_types(keys=names, args=[keys[name] for name in names])

    def _file_indexes(self, meta: FileMeta) -> dict[str, str]:
        return {self._k("owner", meta.owner, "files"): "zset", self._k("expiry"): "zset"}

    def _batch_indexes(self, owner: str | None, tenant: str | None) -> dict[str, str]:
        found = {self._k("active"): "zset", self._k("finished"): "zset"}
        if owner is not None and tenant is not None:
            found |= {self._k("owner", owner, "batches"): "zset", self._k("tenant", tenant, "batches"): "zset"}
        return found

    # --- files --------------------------------------------------------------------------------------
    async def add_file(self, meta: FileMeta, content: Path, spans: Sequence[int], *, limits: tuple[int, int]) -> None:
        usage = self._k("tenant", meta.tenant, "usage")
        admitted, files, used = await self._reserve(keys=[usage], args=[meta.bytes, limits[0], limits[1]])
        if not int(admitted):
            raise QuotaExceeded(
                f"tenant '{meta.tenant}' keeps {int(files)} files of {int(used)} bytes "
                f"(limits: {limits[0]} files, {limits[1]} bytes)"
            )
        data_key = self._k("file", meta.id, "data")
        try:
            meta.seq = int(await self._seq(keys=[self._k("seq")]))
            await self.client.delete(data_key)
            with open(content, "rb") as fh:  # noqa: ASYNC230 - 1 MiB reads, each followed by a round trip
                while chunk := fh.read(_CHUNK):
                    await self.client.append(data_key, chunk)
            await self._typed(self._file_indexes(meta))
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.set(self._k("file", meta.id, "idx"), array("Q", spans).tobytes())
                pipe.set(self._k("file", meta.id), orjson.dumps(meta.to_dict()))
                pipe.zadd(self._k("owner", meta.owner, "files"), {meta.id: meta.seq})
                if meta.expires_at is not None:
                    pipe.zadd(self._k("expiry"), {meta.id: meta.expires_at})
                await pipe.execute()
        except BaseException:
            await asyncio.shield(self._undo_file(meta))
            raise

    async def _undo_file(self, meta: FileMeta) -> None:
        await self._typed(self._file_indexes(meta))
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("file", meta.id), self._k("file", meta.id, "data"), self._k("file", meta.id, "idx"))
            pipe.zrem(self._k("owner", meta.owner, "files"), meta.id)
            pipe.zrem(self._k("expiry"), meta.id)
            await pipe.execute()
        await self._give_back(keys=[self._k("tenant", meta.tenant, "usage")], args=[meta.bytes])

    async def get_file(self, file_id: str) -> FileMeta | None:
        raw = await _or_empty(self.client.get(self._k("file", file_id)), None)
        return read_file_meta(raw) if raw is not None else None

    async def list_files(self, owner: str) -> list[FileMeta]:
        found = await _or_empty(self.client.zrevrange(self._k("owner", owner, "files"), 0, -1), [])
        ids = [_text(i) for i in found]
        if not ids:
            return []
        raws = await self.client.mget([self._k("file", i) for i in ids])  # (MGET reads another type as nil)
        return [meta for raw in raws if raw is not None and (meta := read_file_meta(raw)) is not None]

    async def delete_file(self, file_id: str) -> bool:
        meta = await self.get_file(file_id)
        if meta is None:
            return False
        await self._typed(self._file_indexes(meta))
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("file", file_id))
            pipe.delete(self._k("file", file_id, "data"), self._k("file", file_id, "idx"))
            pipe.zrem(self._k("owner", meta.owner, "files"), file_id)
            pipe.zrem(self._k("expiry"), file_id)
            deleted, *_ = await pipe.execute()
        if deleted:  # the replica whose delete removed the record gives the quota back
            await self._give_back(keys=[self._k("tenant", meta.tenant, "usage")], args=[meta.bytes])
        return bool(deleted)

    async def expired_files(self, now_s: float) -> list[str]:
        return [_text(i) for i in await _or_empty(self.client.zrangebyscore(self._k("expiry"), "-inf", now_s), [])]

    async def read_lines(self, file_id: str, indices: Sequence[int]) -> list[bytes]:
        raw = _bytes(await _or_empty(self.client.get(self._k("file", file_id, "idx")), b""))
        spans: array[int] = array("Q")
        spans.frombytes(raw[: len(raw) - len(raw) % spans.itemsize])  # whole 8-byte spans only
        data_key = self._k("file", file_id, "data")
        async with self.client.pipeline(transaction=False) as pipe:
            present = [i for i in indices if i >= 0 and 2 * i + 1 < len(spans)]
            for i in present:
                offset, length = spans[2 * i], spans[2 * i + 1]
                pipe.getrange(data_key, offset, offset + length - 1)
            got = await pipe.execute(raise_on_error=False)
        # a line whose span or bytes are gone reads as empty (it then fails as not a request)
        lines = {i: _bytes(line) for i, line in zip(present, got, strict=True) if not isinstance(line, Exception)}
        return [lines.get(i, b"") for i in indices]

    async def content_bytes(self, file_id: str) -> int:
        return int(await _or_empty(self.client.strlen(self._k("file", file_id, "data")), 0))

    async def content(self, file_id: str) -> AsyncIterator[bytes]:
        data_key = self._k("file", file_id, "data")
        size = int(await _or_empty(self.client.strlen(data_key), 0))
        for offset in range(0, size, _CHUNK):
            yield _bytes(await _or_empty(self.client.getrange(data_key, offset, min(offset + _CHUNK, size) - 1), b""))

    # --- batches ------------------------------------------------------------------------------------
    async def add_batch(self, meta: BatchMeta) -> None:
        meta.seq = int(await self._seq(keys=[self._k("seq")]))
        await self._typed(self._batch_indexes(meta.owner, meta.tenant))
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self._k("batch", meta.id), orjson.dumps(meta.to_dict()))
            pipe.zadd(self._k("owner", meta.owner, "batches"), {meta.id: meta.seq})
            pipe.zadd(self._k("tenant", meta.tenant, "batches"), {meta.id: meta.seq})
            if meta.status not in FINISHED:
                pipe.zadd(self._k("active"), {meta.id: meta.seq})
            else:
                pipe.zadd(self._k("finished"), {meta.id: meta.finished_at or 0})
            await pipe.execute()

    async def get_batch(self, batch_id: str) -> BatchMeta | None:
        raw = await _or_empty(self.client.get(self._k("batch", batch_id)), None)
        return read_batch_meta(raw) if raw is not None else None

    async def _batches(self, index: str, reverse: bool) -> list[BatchMeta]:
        found = await _or_empty((self.client.zrevrange if reverse else self.client.zrange)(index, 0, -1), [])
        ids = [_text(i) for i in found]
        if not ids:
            return []
        raws = await self.client.mget([self._k("batch", i) for i in ids])  # (MGET reads another type as nil)
        return [meta for raw in raws if raw is not None and (meta := read_batch_meta(raw)) is not None]

    async def list_batches(self, owner: str) -> list[BatchMeta]:
        return await self._batches(self._k("owner", owner, "batches"), reverse=True)

    async def tenant_batches(self, tenant: str) -> list[BatchMeta]:
        return await self._batches(self._k("tenant", tenant, "batches"), reverse=False)

    async def update_batch(self, batch_id: str, when: Collection[str], **changes: Any) -> BatchMeta | None:
        key = self._k("batch", batch_id)
        await self._typed(self._batch_indexes(None, None))
        async with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await _or_empty(pipe.get(key), None)
                    meta = read_batch_meta(raw) if raw is not None else None
                    if meta is None or meta.status not in when:
                        return None
                    for name, value in changes.items():
                        setattr(meta, name, value)
                    pipe.multi()  # type: ignore[no-untyped-call, unused-ignore]
                    pipe.set(key, orjson.dumps(meta.to_dict()))
                    if meta.status in FINISHED:
                        pipe.zrem(self._k("active"), batch_id)
                        pipe.zadd(self._k("finished"), {batch_id: meta.finished_at or 0})
                    await pipe.execute()
                    return meta
                except WatchError:
                    continue

    async def delete_batch(self, batch_id: str) -> None:
        meta = await self.get_batch(batch_id)
        await self.drop_progress(batch_id)
        owner, tenant = (meta.owner, meta.tenant) if meta is not None else (None, None)
        await self._typed(self._batch_indexes(owner, tenant))
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("batch", batch_id))
            pipe.zrem(self._k("active"), batch_id)
            pipe.zrem(self._k("finished"), batch_id)
            if meta is not None:
                pipe.zrem(self._k("owner", meta.owner, "batches"), batch_id)
                pipe.zrem(self._k("tenant", meta.tenant, "batches"), batch_id)
            await pipe.execute()

    async def expired_batches(self, finished_before_s: float) -> list[str]:
        found = await _or_empty(self.client.zrangebyscore(self._k("finished"), "-inf", finished_before_s), [])
        return [_text(i) for i in found]

    async def active_batches(self) -> list[str]:
        return [_text(i) for i in await _or_empty(self.client.zrange(self._k("active"), 0, -1), [])]

    # --- lines --------------------------------------------------------------------------------------
    def _line_keys(self, batch_id: str) -> tuple[str, str, str, str, str]:
        b = self._k("batch", batch_id)
        return f"{b}:cursor", f"{b}:lease", f"{b}:retry", f"{b}:res", f"{b}:counts"

    async def counts(self, batch_id: str) -> Counts:
        raw = await _or_empty(self.client.hgetall(self._line_keys(batch_id)[4]), {})
        got = {_text(k): _integer(v) for k, v in raw.items()}
        return Counts(
            got.get("ok", 0), got.get("failed", 0), got.get("input", 0), got.get("cached", 0), got.get("output", 0)
        )

    async def _total(self, batch_id: str) -> int:
        meta = await self.get_batch(batch_id)
        return meta.total if meta is not None else 0

    async def claim(self, batch_id: str, n: int, lease_s: float) -> list[int]:
        cursor, lease, retry, res, _counts = self._line_keys(batch_id)
        total = await self._total(batch_id)
        got = await self._claim(keys=[cursor, lease, retry, res], args=[n, int(lease_s * 1000), total])
        return [int(i) for i in got]

    async def renew(self, batch_id: str, indices: Collection[int], lease_s: float) -> None:
        if indices:
            await self._renew(keys=[self._line_keys(batch_id)[1]], args=[int(lease_s * 1000), *indices])

    async def defer(self, batch_id: str, indices: Collection[int], delay_s: float) -> None:
        if indices:
            _cursor, lease, retry, res, _counts = self._line_keys(batch_id)
            await self._defer(keys=[lease, retry, res], args=[int(max(delay_s, 0.0) * 1000), *indices])

    async def record(self, batch_id: str, results: Sequence[LineResult]) -> list[bool]:
        if not results:
            return []
        _cursor, lease, _retry, res, counts = self._line_keys(batch_id)
        args: list[Any] = []
        for r in results:
            args += [r.index, r.record(), "ok" if r.ok else "failed", *r.usage]
        got = await asyncio.shield(self._record(keys=[res, lease, counts], args=args))
        return [bool(int(flag)) for flag in got]

    async def held(self, batch_id: str) -> int:
        return int(await self._held(keys=[self._line_keys(batch_id)[1]]))

    async def unrecorded(self, batch_id: str) -> list[int]:
        total = await self._total(batch_id)
        found = await _or_empty(self.client.hkeys(self._line_keys(batch_id)[3]), [])
        done = {int(text) for k in found if (text := _text(k)).isascii() and text.isdigit()}
        return [i for i in range(total) if i not in done]

    async def results(self, batch_id: str) -> AsyncIterator[LineResult]:
        total = await self._total(batch_id)
        res = self._line_keys(batch_id)[3]
        for start in range(0, total, _READ_BATCH):
            fields = list(range(start, min(start + _READ_BATCH, total)))
            for raw in await _or_empty(self.client.hmget(res, fields), []):
                result = LineResult.read(_bytes(raw)) if raw is not None else None
                if result is not None:  # (a record that does not parse is no result: the line is left out)
                    yield result

    async def drop_progress(self, batch_id: str) -> None:
        await self.client.delete(*self._line_keys(batch_id))

    async def close(self) -> None:
        await self.client.aclose()

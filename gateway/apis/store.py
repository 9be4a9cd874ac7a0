"""Stored responses (`store: true`, `previous_response_id`, `GET` / `DELETE /v1/responses/{id}`).

Keyed by the API key that created them: another key's id answers 404, as an unknown one does (no
existence leak). Each entry is the response object and the conversation items it continues
(`backends.protocols.responses.conversation_items`), one JSON blob: `entry_blob` writes it around
the response's bytes as the client got them (not encoded a second time), and it is decoded only
when a later request reads it. Response ids are the gateway's own random ones
(`new_response_id`), never an engine's or anything derived from the request.

Bounds are per owner: a key over `max_responses_per_key` or `max_bytes_per_key` loses its *own*
oldest responses, never another key's (one key storing 300 large responses must not erase a
neighbour's conversation).

- `MemoryResponseStore`: one process; per key an LRU bounded by count and bytes, entries expire
  after `ttl_s`. The process-wide `max_responses` / `max_bytes` guard memory: when they are
  reached (after dropping expired entries) a new response is answered but not stored.
- `RedisResponseStore` (`state.backend: redis`): a conversation continues on any gateway replica.
  One key per response with Redis's own expiry, and per API key a sorted set of its ids by time and
  a hash of their sizes; one script stores a response and trims that key's own oldest beyond its
  bounds. Entries over `max_response_bytes` are not stored by either (the response still answers;
  its id then cannot be continued).

What Redis holds is read as input (another replica's version, a hand edit, a restore can leave
anything there; `bench/chaos/state_fuzz.py`): an entry that is not one (`read_entry`) is a response
not found, a key of the wrong type is replaced by the store script, and a Redis that cannot answer
costs the store, never the answer: a response not kept is still answered, and a read it cannot make
is a 503 `store_unavailable` (`StoreUnavailable`), not a failure of the gateway.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final, Protocol

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from gateway.app.settings import ResponseStoreSettings
from gateway.errors import GatewayError

log = logging.getLogger("tokenway.apis.store")

_SWEEP_EVERY_S: Final = 1.0  # a full process store looks for expired entries at most this often
_WARN_EVERY_S: Final = 60.0  # "the store is full" is logged at most this often


_ID_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


class StoreUnavailable(GatewayError):
    """The shared store did not answer a read (Redis away or timing out): retry, nothing was lost."""

    status = 503
    type = "server_error"
    code = "store_unavailable"


def read_entry(blob: bytes) -> dict[str, Any] | None:
    """A stored entry (`entry_blob`), or None for bytes that are not one: a response object, its
    conversation items (objects) and, maybe, its program (text). Every reader of the shared store
    goes through here, so a corrupted entry is a response not found, never a failure further on."""
    try:
        value = orjson.loads(blob)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("response"), dict):
        return None
    items, program = value.get("items"), value.get("program")
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        return None
    if program is not None and not isinstance(program, str):
        return None
    return value


def is_response_id(value: str) -> bool:
    """Whether `value` can be one of the gateway's response ids (anything else is looked up nowhere:
    a client's id never becomes part of another storage key)."""
    return value.startswith("resp_") and 5 < len(value) <= 64 and _ID_CHARS.issuperset(value)


def new_response_id() -> str:
    """A response id: 144 random bits, url-safe (never derived from the request or the engine)."""
    return "resp_" + secrets.token_urlsafe(18)


class ResponseStore(Protocol):
    async def put(self, key_id: str, response_id: str, blob: bytes) -> bool:
        """Keep `blob` (an `entry_blob`); False where it is not kept (over `max_response_bytes` or
        the owner's byte bound, or the process store is full)."""
        ...

    async def get(self, key_id: str, response_id: str) -> dict[str, Any] | None: ...

    async def delete(self, key_id: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


def entry_blob(response: bytes, items: list[dict[str, Any]], program: str | None = None) -> bytes:
    """The stored entry `{"response": ..., "items": [...], "program": ...}` around the response's JSON
    bytes (`program`: the agent program of the conversation, when there is one)."""
    tail = b',"program":' + orjson.dumps(program) if program is not None else b""
    return b'{"response":' + response + b',"items":' + orjson.dumps(items) + tail + b"}"


def _fits(settings: ResponseStoreSettings, blob: bytes) -> bool:
    return len(blob) <= settings.max_response_bytes and len(blob) <= settings.max_bytes_per_key


class _Owner:
    """One key's responses, least recently used first, and their bytes."""

    __slots__ = ("bytes", "entries")

    def __init__(self) -> None:
        self.entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0


class MemoryResponseStore:
    def __init__(self, settings: ResponseStoreSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._owners: dict[str, _Owner] = {}
        self.count = 0
        self.bytes = 0
        self.refused = 0  # responses not stored because the process store was full
        self._swept_s = -_SWEEP_EVERY_S
        self._warned_s = -_WARN_EVERY_S

    def __len__(self) -> int:
        return self.count

    def owned(self, key_id: str) -> tuple[int, int]:
        """(responses, bytes) the key holds."""
        owner = self._owners.get(key_id)
        return (len(owner.entries), owner.bytes) if owner is not None else (0, 0)

    def _drop(self, key_id: str, owner: _Owner, response_id: str) -> bool:
        found = owner.entries.pop(response_id, None)
        if found is None:
            return False
        owner.bytes -= len(found[1])
        self.bytes -= len(found[1])
        self.count -= 1
        if not owner.entries:
            del self._owners[key_id]
        return True

    async def put(self, key_id: str, response_id: str, blob: bytes) -> bool:
        settings = self.settings
        if not _fits(settings, blob):
            return False
        owner = self._owners.get(key_id)
        if owner is not None:
            self._drop(key_id, owner, response_id)  # (inline: an awaited delete was a coroutine per put)
            # The key's own oldest make room for it: never another key's.
            while key_id in self._owners and (
                len(owner.entries) + 1 > settings.max_responses_per_key
                or owner.bytes + len(blob) > settings.max_bytes_per_key
            ):
                self._drop(key_id, owner, next(iter(owner.entries)))
        if not self._room(len(blob)):
            self._full(key_id)
            return False
        owner = self._owners.get(key_id)
        if owner is None:
            owner = self._owners[key_id] = _Owner()
        owner.entries[response_id] = (self.clock() + settings.ttl_s, blob)
        owner.bytes += len(blob)
        self.bytes += len(blob)
        self.count += 1
        return True

    def _room(self, size: int) -> bool:
        settings = self.settings
        if self.count + 1 <= settings.max_responses and self.bytes + size <= settings.max_bytes:
            return True
        now = self.clock()
        if now - self._swept_s >= _SWEEP_EVERY_S:
            self._swept_s = now
            for key_id, owner in list(self._owners.items()):
                for response_id in [r for r, (expiry, _) in owner.entries.items() if expiry <= now]:
                    self._drop(key_id, owner, response_id)
        return self.count + 1 <= settings.max_responses and self.bytes + size <= settings.max_bytes

    def _full(self, key_id: str) -> None:
        self.refused += 1
        now = self.clock()
        if now - self._warned_s >= _WARN_EVERY_S:
            self._warned_s = now
            log.warning(
                "the response store is full (%d responses, %d bytes; apis.response_store.max_responses / "
                "max_bytes): a response of key %r was answered but not stored (%d not stored so far)",
                self.count,
                self.bytes,
                key_id,
                self.refused,
            )

    async def get(self, key_id: str, response_id: str) -> dict[str, Any] | None:
        owner = self._owners.get(key_id)
        found = owner.entries.get(response_id) if owner is not None else None
        if owner is None or found is None:
            return None
        expiry, blob = found
        if expiry <= self.clock():
            self._drop(key_id, owner, response_id)
            return None
        owner.entries.move_to_end(response_id)
        value: dict[str, Any] = orjson.loads(blob)
        return value

    async def delete(self, key_id: str, response_id: str) -> bool:
        owner = self._owners.get(key_id)
        return owner is not None and self._drop(key_id, owner, response_id)

    async def close(self) -> None:
        self._owners.clear()
        self.count = 0
        self.bytes = 0


# KEYS: the entry, the key's index (id -> time), the key's sizes (id -> bytes).
# ARGV: id, blob, ttl ms, now ms, max responses, max bytes, the entry key prefix (prefix .. id).
# Forgets the key's expired ids, stores the entry, then pops the key's own oldest beyond its bounds
# (never the one just stored). Returns how many it dropped.
_PUT: Final = """
local index, sizes = KEYS[2], KEYS[3]
local id, blob, ttl, now = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local max_count, max_bytes, prefix = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
-- a key of another type (written by something else) is replaced, not failed on
local kind = redis.call('TYPE', index).ok
if kind ~= 'zset' and kind ~= 'none' then redis.call('DEL', index) end
kind = redis.call('TYPE', sizes).ok
if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', sizes) end
local function size(value) return math.max(tonumber(value) or 0, 0) end
local expired = redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl)
for _, old in ipairs(expired) do redis.call('HDEL', sizes, old) end
redis.call('ZREMRANGEBYSCORE', index, '-inf', now - ttl)
redis.call('SET', KEYS[1], blob, 'PX', ttl)
redis.call('ZREM', index, id)
local newest = redis.call('ZRANGE', index, -1, -1, 'WITHSCORES')[2]
local score = now
newest = tonumber(newest)
if newest and newest >= now and newest < now + 1000 then score = newest + 0.001 end  -- order within one ms
redis.call('ZADD', index, score, id)
redis.call('HSET', sizes, id, string.len(blob))
local total = 0
for _, value in ipairs(redis.call('HVALS', sizes)) do total = total + size(value) end
local dropped = 0
while redis.call('ZCARD', index) > 1 and (redis.call('ZCARD', index) > max_count or total > max_bytes) do
  local oldest = redis.call('ZRANGE', index, 0, 0)[1]
  if oldest == id then oldest = redis.call('ZRANGE', index, 1, 1)[1] end
  total = total - size(redis.call('HGET', sizes, oldest))
  redis.call('ZREM', index, oldest)
  redis.call('HDEL', sizes, oldest)
  redis.call('DEL', prefix .. oldest)
  dropped = dropped + 1
end
redis.call('PEXPIRE', index, ttl)
redis.call('PEXPIRE', sizes, ttl)
return dropped
"""


class RedisResponseStore:
    def __init__(self, client: aioredis.Redis, settings: ResponseStoreSettings, prefix: str) -> None:
        self.client = client
        self.settings = settings
        self.prefix = prefix
        self._put = client.register_script(_PUT)
        self.failures = 0
        self._warned_s = -_WARN_EVERY_S

    @classmethod
    def from_url(cls, url: str, settings: ResponseStoreSettings, prefix: str) -> RedisResponseStore:
        return cls(aioredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0), settings, prefix)

    def _base(self, key_id: str) -> str:
        return f"{self.prefix}:resp:{{{key_id}}}:"  # one hash slot per API key

    def _key(self, key_id: str, response_id: str) -> str:
        return self._base(key_id) + response_id  # ids are `resp_...`: never `index` or `sizes`

    def _index(self, key_id: str) -> str:
        return self._base(key_id) + "index"

    def _sizes(self, key_id: str) -> str:
        return self._base(key_id) + "sizes"

    async def put(self, key_id: str, response_id: str, blob: bytes) -> bool:
        settings = self.settings
        if not _fits(settings, blob):
            return False
        keys = [self._key(key_id, response_id), self._index(key_id), self._sizes(key_id)]
        args: list[Any] = [
            response_id,
            blob,
            int(settings.ttl_s * 1000),
            int(time.time() * 1000),
            settings.max_responses_per_key,
            settings.max_bytes_per_key,
            self._base(key_id),
        ]
        try:
            await self._put(keys=keys, args=args)
        except RedisError as exc:  # the answer goes out all the same: it just cannot be continued
            self._warn("store", exc)
            return False
        return True

    async def get(self, key_id: str, response_id: str) -> dict[str, Any] | None:
        if not is_response_id(response_id):
            return None
        try:
            blob = await self.client.get(self._key(key_id, response_id))
        except ResponseError as exc:  # a key of another type: no entry of ours
            self._warn("read", exc)
            return None
        except RedisError as exc:
            self._warn("read", exc)
            raise StoreUnavailable("The response store is not answering; retry the request.") from None
        if blob is None:
            return None
        entry = read_entry(blob if isinstance(blob, bytes) else blob.encode())
        if entry is None:
            self._warn("read", f"entry {response_id!r} of key {key_id!r} is not a stored response")
        return entry

    async def delete(self, key_id: str, response_id: str) -> bool:
        if not is_response_id(response_id):
            return False
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(self._key(key_id, response_id))
                pipe.zrem(self._index(key_id), response_id)
                pipe.hdel(self._sizes(key_id), response_id)
                # the entry's DEL is what says it existed; the index and sizes may be of another type
                deleted, _, _ = await pipe.execute(raise_on_error=False)
        except RedisError as exc:
            self._warn("delete", exc)
            raise StoreUnavailable("The response store is not answering; retry the request.") from None
        return isinstance(deleted, int) and deleted > 0

    def _warn(self, what: str, problem: object) -> None:
        """One warning a minute for the store's failures: a Redis away would otherwise log per request."""
        self.failures += 1
        now = time.monotonic()
        if now - self._warned_s >= _WARN_EVERY_S:
            self._warned_s = now
            log.warning("response store %s failed (%d failures so far): %s", what, self.failures, problem)

    async def close(self) -> None:
        await self.client.aclose()


def make_response_store(settings: ResponseStoreSettings, redis_url: str | None, prefix: str) -> ResponseStore:
    if redis_url:
        return RedisResponseStore.from_url(redis_url, settings, prefix)
    return MemoryResponseStore(settings)

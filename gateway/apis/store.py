"""Stored responses (`store: true`, `previous_response_id`, `GET` / `DELETE /v1/responses/{id}`).

Keyed by the API key that created them: another key's id answers 404, as an unknown one does (no
existence leak). Each entry is the response object and the conversation items it continues
(`backends.protocols.responses.conversation_items`), one JSON blob: `entry_blob` writes it around
the response's bytes as the client got them (not encoded a second time), and it is decoded only
when a later request reads it.

- `MemoryResponseStore`: one process; an LRU bounded by count and total bytes, entries expire
  after `ttl_s`.
- `RedisResponseStore` (`state.backend: redis`): a conversation continues on any gateway replica.
  One key per response with Redis's own expiry, and per API key a sorted set of its ids by time,
  trimmed to `max_responses` (the oldest are deleted). Entries over `max_response_bytes` are not
  stored by either (the response still answers; its id then cannot be continued).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis

from gateway.apis.config import ResponseStoreSettings

log = logging.getLogger("tokenway.apis.store")


class ResponseStore(Protocol):
    async def put(self, key_id: str, response_id: str, blob: bytes) -> bool:
        """Keep `blob` (an `entry_blob`); False where it is over `max_response_bytes`."""
        ...

    async def get(self, key_id: str, response_id: str) -> dict[str, Any] | None: ...

    async def delete(self, key_id: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


def entry_blob(response: bytes, items: list[dict[str, Any]]) -> bytes:
    """The stored entry `{"response": ..., "items": [...]}` around the response's JSON bytes."""
    return b'{"response":' + response + b',"items":' + orjson.dumps(items) + b"}"


class MemoryResponseStore:
    def __init__(self, settings: ResponseStoreSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, key_id: str, response_id: str, blob: bytes) -> bool:
        if len(blob) > self.settings.max_response_bytes:
            return False
        key = (key_id, response_id)
        replaced = self._entries.pop(key, None)  # (inline: an awaited delete was a coroutine per put)
        if replaced is not None:
            self.bytes -= len(replaced[1])
        self._entries[key] = (self.clock() + self.settings.ttl_s, blob)
        self.bytes += len(blob)
        while len(self._entries) > self.settings.max_responses or self.bytes > self.settings.max_bytes:
            _key, (_expiry, old) = self._entries.popitem(last=False)
            self.bytes -= len(old)
        return True

    async def get(self, key_id: str, response_id: str) -> dict[str, Any] | None:
        found = self._entries.get((key_id, response_id))
        if found is None:
            return None
        expiry, blob = found
        if expiry <= self.clock():
            await self.delete(key_id, response_id)
            return None
        self._entries.move_to_end((key_id, response_id))
        value: dict[str, Any] = orjson.loads(blob)
        return value

    async def delete(self, key_id: str, response_id: str) -> bool:
        found = self._entries.pop((key_id, response_id), None)
        if found is None:
            return False
        self.bytes -= len(found[1])
        return True

    async def close(self) -> None:
        self._entries.clear()
        self.bytes = 0


class RedisResponseStore:
    def __init__(self, client: aioredis.Redis, settings: ResponseStoreSettings, prefix: str) -> None:
        self.client = client
        self.settings = settings
        self.prefix = prefix

    @classmethod
    def from_url(cls, url: str, settings: ResponseStoreSettings, prefix: str) -> RedisResponseStore:
        return cls(aioredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0), settings, prefix)

    def _key(self, key_id: str, response_id: str) -> str:
        return f"{self.prefix}:resp:{{{key_id}}}:{response_id}"

    def _index(self, key_id: str) -> str:
        return f"{self.prefix}:resp:{{{key_id}}}:index"

    async def put(self, key_id: str, response_id: str, blob: bytes) -> bool:
        if len(blob) > self.settings.max_response_bytes:
            return False
        ttl_ms = int(self.settings.ttl_s * 1000)
        index = self._index(key_id)
        now_ms = int(time.time() * 1000)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self._key(key_id, response_id), blob, px=ttl_ms)
            pipe.zadd(index, {response_id: now_ms})
            pipe.zremrangebyscore(index, "-inf", now_ms - ttl_ms)  # ids whose entry expired
            pipe.pexpire(index, ttl_ms)
            pipe.zcard(index)
            results = await pipe.execute()
        excess = int(results[-1]) - self.settings.max_responses
        if excess > 0:
            oldest: list[Any] = list(await self.client.zpopmin(index, excess))
            if oldest:
                await self.client.delete(*(self._key(key_id, self._text(pair[0])) for pair in oldest))
        return True

    @staticmethod
    def _text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    async def get(self, key_id: str, response_id: str) -> dict[str, Any] | None:
        blob = await self.client.get(self._key(key_id, response_id))
        if blob is None:
            return None
        value: dict[str, Any] = orjson.loads(blob)
        return value

    async def delete(self, key_id: str, response_id: str) -> bool:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(key_id, response_id))
            pipe.zrem(self._index(key_id), response_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def close(self) -> None:
        await self.client.aclose()


def make_response_store(settings: ResponseStoreSettings, redis_url: str | None, prefix: str) -> ResponseStore:
    if redis_url:
        return RedisResponseStore.from_url(redis_url, settings, prefix)
    return MemoryResponseStore(settings)

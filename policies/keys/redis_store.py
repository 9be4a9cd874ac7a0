"""Keys, tenants and limit overrides in Redis (`state: redis`): one hash of documents per kind, a version counter,
and a channel on which every write announces itself, so each replica applies it within
milliseconds (the directory also polls the version: a message lost while a subscriber was
reconnecting is repaired by a full reload).

A write is one script: store (or delete) the document, increment the version, publish
`"<version> <kind> <name>"`, so the versions a subscriber sees are consecutive unless it missed one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from policies.keys.store import KINDS, Change, Kind, Snapshot

_WRITE = """
if ARGV[3] == '1' then redis.call('HDEL', KEYS[1], ARGV[1]) else redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
local v = redis.call('INCR', KEYS[2])
redis.call('PUBLISH', ARGV[4], v .. ' ' .. ARGV[5] .. ' ' .. ARGV[1])
return v
"""

_RESTORE = """
local version = KEYS[#KEYS]
if redis.call('EXISTS', version) == 1 then return 0 end
local i = 2
while i <= #ARGV do
  local kind, name, doc = tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2]
  redis.call('HSET', KEYS[kind], name, doc)
  i = i + 3
end
redis.call('SET', version, ARGV[1])
return 1
"""

_TOUCH = """
for i = 1, #ARGV, 2 do
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > old then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return 1
"""


class RedisDirectoryStore:
    name = "redis"

    def __init__(self, client: Redis, prefix: str = "tokenway") -> None:
        self.client = client
        tag = "{" + prefix + "}:dir:"
        self._docs = {kind: f"{tag}{kind}s" for kind in KINDS}
        self._version = tag + "version"
        self._last_used = tag + "last_used"
        self.channel = tag + "changes"
        self._write = client.register_script(_WRITE)
        self._touch = client.register_script(_TOUCH)
        self._restore = client.register_script(_RESTORE)

    @classmethod
    def from_url(cls, url: str, prefix: str = "tokenway") -> RedisDirectoryStore:
        return cls(Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0), prefix)

    async def load(self) -> Snapshot:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.get(self._version)
            for kind in KINDS:
                pipe.hgetall(self._docs[kind])
            version, *maps = await pipe.execute()
        snapshot = Snapshot(int(version or 0))
        for kind, docs in zip(KINDS, maps, strict=True):
            snapshot.docs[kind] = {_text(k): _text(v) for k, v in docs.items()}
        return snapshot

    async def write(self, kind: Kind, name: str, doc: str | None) -> int:
        args = [name, doc or "", "1" if doc is None else "0", self.channel, kind]
        return int(await self._write(keys=[self._docs[kind], self._version], args=args))

    async def restore(self, snapshot: Snapshot) -> bool:
        """Put a whole copy back into a Redis that lost everything (no version counter): atomically,
        and only if no other replica did first. True when this call restored it."""
        args: list[str | int] = [max(snapshot.version, 1)]
        for index, kind in enumerate(KINDS, start=1):  # the kind as its hash's position in KEYS
            for name, doc in snapshot.docs[kind].items():
                args += [index, name, doc]
        keys = [*(self._docs[kind] for kind in KINDS), self._version]
        return bool(await self._restore(keys=keys, args=args))

    async def fetch(self, kind: Kind, name: str) -> str | None:
        found = await self.client.hget(self._docs[kind], name)
        return None if found is None else _text(found)

    async def version(self) -> int:
        return int(await self.client.get(self._version) or 0)

    async def touch(self, last_used: dict[str, float]) -> None:
        if last_used:
            args = [item for key_id, at_s in last_used.items() for item in (key_id, repr(at_s))]
            await self._touch(keys=[self._last_used], args=args)

    async def last_used(self) -> dict[str, float]:
        found = await self.client.hgetall(self._last_used)
        return {_text(k): float(v) for k, v in found.items()}

    def changes(self) -> AsyncIterator[Change] | None:
        return self._listen()

    async def _listen(self) -> AsyncIterator[Change]:
        """Every write's announcement, in order, after a version-0 marker once subscribed; raises when
        the connection drops (the caller resubscribes and reloads)."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.channel)
        try:
            yield Change(0, "key", "")  # subscribed: the caller reloads to cover what it missed before
            while True:
                message = await pubsub.get_message(timeout=1.0)
                if message is None or message.get("type") != "message":
                    continue
                version, kind, name = _text(message["data"]).split(" ", 2)
                if kind in KINDS:
                    yield Change(int(version), kind, name)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]

    async def close(self) -> None:
        await self.client.aclose()


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value

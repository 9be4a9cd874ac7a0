"""Keys in Redis with a durable copy behind them (`state: redis` with `state.keys_db` set, the default).

Redis is what replicas share: every write goes there first, is announced, and every replica applies
it. But a Redis run as a cache (no RDB, no AOF) forgets everything when it restarts, and keys made
through the admin API exist nowhere else: every one of them would answer 401 on every replica.
So each replica also keeps what it wrote or applied in a local SQLite file (the same format as the
single-process store), and a load that finds Redis empty, with no version counter (a restart or a
flush, not a fresh deployment's first write), puts that copy back: atomically, and only once
however many replicas notice together (`RedisDirectoryStore.restore`). Replicas notice within a
second: their subscription drops with the connection and resubscribing reloads; the version poll
sees the counter go back.

The copy is written after Redis acknowledged the write; a failure to write it is logged, never the
API's error (Redis holds the change; the next full load rewrites the copy whole).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable

from policies.keys.redis_store import RedisDirectoryStore
from policies.keys.sqlite_store import SqliteDirectoryStore
from policies.keys.store import Change, Kind, Snapshot

log = logging.getLogger(__name__)


class MirroredDirectoryStore:
    name = "redis+sqlite"

    def __init__(self, primary: RedisDirectoryStore, copy: SqliteDirectoryStore) -> None:
        self.primary = primary
        self.copy = copy
        self.restored = 0  # how many times this replica put the copy back into an empty Redis

    async def load(self) -> Snapshot:
        snapshot = await self.primary.load()
        if snapshot.version == 0 and not any(snapshot.docs.values()):
            kept = await self.copy.load()
            if any(kept.docs.values()):
                if await self.primary.restore(kept):
                    self.restored += 1
                    counts = ", ".join(f"{len(docs)} {kind}(s)" for kind, docs in kept.docs.items())
                    log.warning("the key store in Redis was empty: restored %s from %s", counts, self.copy.path)
                snapshot = await self.primary.load()
                return snapshot  # the copy already holds it (or another replica's, which came from the same)
        await self._keep(self.copy.replace_all(snapshot))
        return snapshot

    async def write(self, kind: Kind, name: str, doc: str | None) -> int:
        if await self.primary.version() == 0:  # Redis lost everything and no reload restored it yet:
            await self.load()  # restore first, so this write does not start a new, empty history
        version = await self.primary.write(kind, name, doc)
        await self._keep(self.copy.put(kind, name, doc, version))
        return version

    async def fetch(self, kind: Kind, name: str) -> str | None:
        """Another replica's write, as announced: applied here, so kept here too."""
        doc = await self.primary.fetch(kind, name)
        await self._keep(self.copy.put(kind, name, doc, None))
        return doc

    async def version(self) -> int:
        return await self.primary.version()

    async def touch(self, last_used: dict[str, float]) -> None:
        await self.primary.touch(last_used)
        await self._keep(self.copy.touch(last_used))

    async def last_used(self) -> dict[str, float]:
        found = await self.copy.last_used()
        for key_id, at_s in (await self.primary.last_used()).items():
            found[key_id] = max(at_s, found.get(key_id, 0.0))
        return found

    def changes(self) -> AsyncIterator[Change] | None:
        return self.primary.changes()

    async def close(self) -> None:
        try:
            await self.primary.close()
        finally:
            await self.copy.close()

    async def _keep(self, step: Awaitable[None]) -> None:
        try:
            await step
        except Exception as exc:
            log.warning("writing the local copy of the key store (%s) failed: %s", self.copy.path, exc)

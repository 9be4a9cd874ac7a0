"""Following a shared key store (Redis): other replicas' writes applied to this replica's index as
they are announced, and a version poll that repairs a missed announcement with a full reload.
"""

from __future__ import annotations

import asyncio
import logging

from policies.keys.index import KeyIndex
from policies.keys.store import DirectoryStore

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5  # version poll of a shared store: the repair path when an announcement is lost


async def follow(index: KeyIndex, store: DirectoryStore) -> None:
    """Apply other replicas' writes as announced; a gap in the versions means a reload."""
    while True:
        changes = store.changes()
        assert changes is not None
        try:
            async for change in changes:
                if change.version == 0:  # (re)subscribed: writes made meanwhile were not announced to us
                    index.replace(await store.load())
                    continue
                if change.version <= index.seen_version:
                    continue  # our own write, already applied, or replayed
                if change.version != index.seen_version + 1:
                    index.replace(await store.load())
                    continue
                index.apply_doc(change.kind, change.name, await store.fetch(change.kind, change.name))
                index.seen_version = change.version
                index.version = max(index.version, change.version)
                index.stats["applied"] += 1
                index.changed()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            index.stats["sync_errors"] += 1
            log.warning("key store subscription lost (%s); resubscribing", exc)
            await asyncio.sleep(POLL_INTERVAL_S)


async def poll(index: KeyIndex, store: DirectoryStore) -> None:
    """Reload when the store's version is ahead of what the announcements brought, twice in a
    row (once may be an announcement still in flight)."""
    behind = 0
    while True:
        await asyncio.sleep(POLL_INTERVAL_S)
        try:
            remote = await store.version()
            behind = behind + 1 if remote != index.seen_version else 0
            if behind >= 2:
                index.replace(await store.load())
                behind = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            index.stats["sync_errors"] += 1
            log.debug("key store version poll failed: %s", exc)

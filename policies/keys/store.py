"""Where keys and tenants made through the admin API are kept: the store's contract, and the
in-memory store (tests, and gateways configured without a database).

A store holds JSON documents by (kind, name) and a version that every write increments. The
directory keeps the authoritative copy in memory (authentication is a dictionary lookup) and the
store makes it survive restarts (SQLite under `var/`) and reach every replica (Redis: each write is
published, and the version is polled as a safety net for a missed message). `last_used` times
travel apart from the documents: they change on every request, the documents almost never.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

Kind = Literal["key", "tenant", "override"]
KINDS: tuple[Kind, ...] = ("key", "tenant", "override")


@dataclass(frozen=True, slots=True)
class Change:
    """One write as announced to the other replicas: the version it produced and what it touched."""

    version: int
    kind: Kind
    name: str


@dataclass(slots=True)
class Snapshot:
    version: int
    docs: dict[Kind, dict[str, str]] = field(default_factory=lambda: {kind: {} for kind in KINDS})


class DirectoryStore(Protocol):
    name: str  # memory | sqlite | redis: shown on /admin/status

    async def load(self) -> Snapshot: ...

    async def write(self, kind: Kind, name: str, doc: str | None) -> int:
        """Store (or with None delete) one document; returns the version after the write."""
        ...

    async def fetch(self, kind: Kind, name: str) -> str | None: ...

    async def version(self) -> int: ...

    async def touch(self, last_used: dict[str, float]) -> None:
        """Record keys' last use (unix s); an older time never overwrites a newer one."""
        ...

    async def last_used(self) -> dict[str, float]: ...

    def changes(self) -> AsyncIterator[Change] | None:
        """Other replicas' writes as they happen, or None when the store has no other writers."""
        ...

    async def close(self) -> None: ...


class MemoryDirectoryStore:
    """Documents in a dict: nothing survives the process (`state.keys_db: null`, tests)."""

    name = "memory"

    def __init__(self) -> None:
        self._snapshot = Snapshot(0)
        self._last_used: dict[str, float] = {}

    async def load(self) -> Snapshot:
        return Snapshot(self._snapshot.version, {k: dict(v) for k, v in self._snapshot.docs.items()})

    async def write(self, kind: Kind, name: str, doc: str | None) -> int:
        docs = self._snapshot.docs[kind]
        if doc is None:
            docs.pop(name, None)
        else:
            docs[name] = doc
        self._snapshot.version += 1
        return self._snapshot.version

    async def fetch(self, kind: Kind, name: str) -> str | None:
        return self._snapshot.docs[kind].get(name)

    async def version(self) -> int:
        return self._snapshot.version

    async def touch(self, last_used: dict[str, float]) -> None:
        for key_id, at_s in last_used.items():
            if at_s > self._last_used.get(key_id, 0.0):
                self._last_used[key_id] = at_s

    async def last_used(self) -> dict[str, float]:
        return dict(self._last_used)

    def changes(self) -> AsyncIterator[Change] | None:
        return None

    async def close(self) -> None:
        await asyncio.sleep(0)

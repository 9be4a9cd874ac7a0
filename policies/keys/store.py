"""Where keys and tenants made through the admin API are kept: the store's contract and its four
stores: in memory (tests, and gateways configured without a database), a local SQLite file, Redis,
and Redis with a durable SQLite copy behind it.

A store holds JSON documents by (kind, name) and a version that every write increments. The
directory keeps the authoritative copy in memory (authentication is a dictionary lookup) and the
store makes it survive restarts (SQLite under `var/`) and reach every replica (Redis: each write is
published, and the version is polled as a safety net for a missed message). `last_used` times
travel apart from the documents: they change on every request, the documents almost never.

SQLite: keys and tenants in a local SQLite file (the embedded default: `state: memory`, `var/keys.sqlite3`).

One process owns the file. Every call runs in a worker thread (sqlite3 blocks), serialised by a
lock over one connection; the gateway only calls it when an operator changes something or, every
few seconds, to save last-use times, never per request. WAL journaling keeps a crash from
corrupting the file and lets `tokenway keys list` read it while the gateway writes.

Redis: keys, tenants and limit overrides in Redis (`state: redis`): one hash of documents per kind, a version counter,
and a channel on which every write announces itself, so each replica applies it within
milliseconds (the directory also polls the version: a message lost while a subscriber was
reconnecting is repaired by a full reload).

A write is one script: store (or delete) the document, increment the version, publish
`"<version> <kind> <name>"`, so the versions a subscriber sees are consecutive unless it missed one.

Mirrored: keys in Redis with a durable copy behind them (`state: redis` with `state.keys_db` set, the default).

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
API's error (Redis holds the change; the next full load rewrites the copy whole). A copy SQLite
cannot read at start-up is the same: while Redis holds the store, the file is set aside
(`<name>.corrupt-<n>`) and written again from Redis; only with Redis empty too does start-up stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from backends.files import set_aside
from policies.limits.scriptpipe import stored_number
from policies.loader import PolicyFileError

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
    # Redis held what no replica writes there (a version that is no count, a documents key of another
    # type): what could be read is here, and a store with a copy puts the rest back (`restore`)
    damaged: bool = False


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


T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (kind TEXT NOT NULL, name TEXT NOT NULL, doc TEXT NOT NULL, PRIMARY KEY (kind, name));
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS last_used (id TEXT PRIMARY KEY, at_s REAL NOT NULL);
INSERT OR IGNORE INTO meta (k, v) VALUES ('version', 0);
"""


class KeyStoreDamaged(PolicyFileError):
    """The key store's file is there but SQLite cannot read it whole: the gateway does not start.
    (A `PolicyFileError`: the keys made through the admin API are part of the policy, and start-up
    answers a policy file it cannot use with its one-line message, gateway/app/server.py.)

    Serving without the keys it holds would answer 401 to every key made through the admin API, a
    lock-out that looks like the clients' fault, and the next write would make the damage permanent
    (a fresh file over the old one). So start-up stops with one line that names the file and the two
    ways on: put a backup back, or move the file aside and make those keys again. With `state: redis`
    the file is Redis's copy, and a Redis that holds the store rebuilds it instead
    (`MirroredDirectoryStore.beside`)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(
            [
                f"the key store {path} cannot be read ({why}); keys and tenants made through the admin API live "
                "there, so the gateway does not start without them: restore the file from a backup, or move it "
                "aside to start with none (those keys must then be made again)"
            ]
        )
        self.path = path
        self.why = why


class SqliteDirectoryStore:
    name = "sqlite"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = _open_checked(self.path)

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def locked() -> T:
            with self._lock:
                return fn(self._db)

        return await asyncio.to_thread(locked)

    async def load(self) -> Snapshot:
        def read(db: sqlite3.Connection) -> Snapshot:
            snapshot = Snapshot(_version(db))
            garbled = 0
            for raw in db.execute(_READ_DOCS):
                kind, name, doc = (_stored_text(value) for value in raw)
                garbled += any(isinstance(value, bytes) and not _is_utf8(value) for value in raw)
                if kind in snapshot.docs:
                    snapshot.docs[kind][name] = doc
            if garbled:
                log.warning(
                    "key store %s: %d documents hold bytes that are not UTF-8 (read with replacement characters; "
                    "one that is no longer a key is named and ignored)",
                    self.path,
                    garbled,
                )
            return snapshot

        return await self._run(read)

    async def write(self, kind: Kind, name: str, doc: str | None) -> int:
        def write(db: sqlite3.Connection) -> int:
            db.execute("BEGIN IMMEDIATE")
            try:
                if doc is None:
                    db.execute("DELETE FROM docs WHERE kind = ? AND name = ?", (kind, name))
                else:
                    db.execute("INSERT OR REPLACE INTO docs (kind, name, doc) VALUES (?, ?, ?)", (kind, name, doc))
                db.execute("UPDATE meta SET v = v + 1 WHERE k = 'version'")
                version = _version(db)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # SQLite ends it itself on some errors (a full disk): say that one
                    db.execute("ROLLBACK")
                raise
            return version

        return await self._run(write)

    async def fetch(self, kind: Kind, name: str) -> str | None:
        def read(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT CAST(doc AS BLOB) FROM docs WHERE kind = ? AND name = ?", (kind, name)).fetchone()
            return None if row is None else _stored_text(row[0])

        return await self._run(read)

    async def version(self) -> int:
        return await self._run(_version)

    async def touch(self, last_used: dict[str, float]) -> None:
        rows = list(last_used.items())

        def write(db: sqlite3.Connection) -> None:
            db.executemany(
                "INSERT INTO last_used (id, at_s) VALUES (?, ?) "
                "ON CONFLICT(id) DO UPDATE SET at_s = max(at_s, excluded.at_s)",
                rows,
            )

        if rows:
            await self._run(write)

    async def last_used(self) -> dict[str, float]:
        def read(db: sqlite3.Connection) -> dict[str, float]:
            rows = db.execute("SELECT id, at_s FROM last_used WHERE typeof(at_s) IN ('real', 'integer')")
            return {str(i): float(t) for i, t in rows if math.isfinite(t)}

        return await self._run(read)

    async def put(self, kind: Kind, name: str, doc: str | None, version: int | None) -> None:
        """Keep a document as another store wrote it (this file as that store's durable copy):
        the version is the other store's, kept when it is newer, never incremented here."""

        def write(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            try:
                _put(db, kind, name, doc)
                if version is not None:
                    db.execute("UPDATE meta SET v = max(v, ?) WHERE k = 'version'", (version,))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # SQLite ends it itself on some errors (a full disk): say that one
                    db.execute("ROLLBACK")
                raise

        await self._run(write)

    async def replace_all(self, snapshot: Snapshot) -> None:
        """Make this file hold exactly `snapshot` (a whole copy of the store it backs), unless it
        already holds a later version: a reload's snapshot read before a write can land after that
        write's `put`, and must not take the copy back (a revocation lost from the copy would come
        back with it when an emptied Redis is restored from it)."""

        def write(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            try:
                if _version(db) > snapshot.version:
                    db.execute("COMMIT")
                    return
                db.execute("DELETE FROM docs")
                for kind, docs in snapshot.docs.items():
                    for name, doc in docs.items():
                        _put(db, kind, name, doc)
                db.execute("UPDATE meta SET v = ? WHERE k = 'version'", (snapshot.version,))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # SQLite ends it itself on some errors (a full disk): say that one
                    db.execute("ROLLBACK")
                raise

        await self._run(write)

    def changes(self) -> AsyncIterator[Change] | None:
        return None

    async def close(self) -> None:
        await self._run(lambda db: db.close())


# Read as bytes: SQLite returns text it holds as it holds it, and a document whose bytes a damage left
# no longer UTF-8 would fail the whole load in Python's decoding (a start-up crash over one key).
_READ_DOCS = "SELECT CAST(kind AS BLOB), CAST(name AS BLOB), CAST(doc AS BLOB) FROM docs"


def _stored_text(value: object) -> str:
    """A stored column as text: UTF-8 with replacement characters where the bytes are not (the
    document then fails its validation and is named and ignored, `policies/keys/index.py`)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _open_checked(path: Path) -> sqlite3.Connection:
    """The key store's connection, after SQLite read the whole file back (`quick_check`: every page
    and index, in milliseconds at the sizes a key store has). A file that is not there is a first
    start: created empty, and said so (a missing file is the one damage SQLite cannot tell from a new
    deployment). A file that is there but empty, not a database, unreadable or damaged raises
    `KeyStoreDamaged`: SQLite would read an empty file as an empty store, and serve without its keys."""
    if not path.exists() and not path.is_symlink():
        log.warning("key store %s not found: starting an empty one (keys made through the admin API live there)", path)
    elif path.is_file() and path.stat().st_size == 0:
        raise KeyStoreDamaged(path, "the file is empty")
    db: sqlite3.Connection | None = None
    try:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        found = [str(row[0]) for row in db.execute("PRAGMA quick_check(5)")]
        if found != ["ok"]:
            raise KeyStoreDamaged(path, "; ".join(found)[:200])
        db.executescript(_SCHEMA)
    except (sqlite3.Error, OSError) as exc:
        if db is not None:
            db.close()
        raise KeyStoreDamaged(path, str(exc) or type(exc).__name__) from None
    except KeyStoreDamaged:
        if db is not None:
            db.close()
        raise
    return db


def _put(db: sqlite3.Connection, kind: str, name: str, doc: str | None) -> None:
    if doc is None:
        db.execute("DELETE FROM docs WHERE kind = ? AND name = ?", (kind, name))
    else:
        db.execute("INSERT OR REPLACE INTO docs (kind, name, doc) VALUES (?, ?, ?)", (kind, name, doc))


def _version(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT v FROM meta WHERE k = 'version'").fetchone()
    return int(row[0]) if row else 0


_WRITE = """
if ARGV[3] == '1' then redis.call('HDEL', KEYS[1], ARGV[1]) else redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
local v = redis.call('INCR', KEYS[2])
redis.call('PUBLISH', ARGV[4], v .. ' ' .. ARGV[5] .. ' ' .. ARGV[1])
return v
"""

# Put the copy back where Redis lost it (no version counter: a restart without persistence, a flush)
# or holds what no replica writes there (a version that is no count, a documents key of another type).
# Only the documents keys that are missing or broken are filled from the copy: a healthy one may be
# newer than the copy (a revocation the copy has not seen must not be undone). Atomic, so of several
# replicas noticing together only the first changes anything.
_RESTORE = """
local version = KEYS[#KEYS]
local v = redis.call('TYPE', version).ok == 'string' and redis.call('GET', version)
local counted = v and string.match(v, '^%d+$') and string.len(v) < 19
local exists = redis.call('EXISTS', version) == 1
local refill = {}
for k = 1, #KEYS - 1 do
  local t = redis.call('TYPE', KEYS[k]).ok
  if t ~= 'hash' and t ~= 'none' then redis.call('DEL', KEYS[k]) end
  refill[k] = not exists or (t ~= 'hash' and t ~= 'none')
end
local any = not counted
for k = 1, #KEYS - 1 do any = any or refill[k] end
if not any then return 0 end
local i = 2
while i <= #ARGV do
  local kind, name, doc = tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2]
  if refill[kind] then redis.call('HSET', KEYS[kind], name, doc) end
  i = i + 3
end
if not counted then redis.call('SET', version, ARGV[1]) end
return 1
"""

_TOUCH = """
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'hash' and t ~= 'none' then redis.call('DEL', KEYS[1]) end -- written by something else
for i = 1, #ARGV, 2 do
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i])) or 0
  if old ~= old then old = 0 end -- NaN
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
        """What Redis holds; a version that is no count or a documents key of another type reads as
        absent and marks the snapshot `damaged` (connection errors raise as before)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.get(self._version)
            for kind in KINDS:
                pipe.hgetall(self._docs[kind])
            version, *maps = await pipe.execute(raise_on_error=False)
        if isinstance(version, Exception):
            _raise_unless_wrong_type(version)
            version = b"?"  # a key of another type: no count
        count = _count(version)
        snapshot = Snapshot(count or 0, damaged=version is not None and count is None)
        for kind, docs in zip(KINDS, maps, strict=True):
            if isinstance(docs, Exception):
                _raise_unless_wrong_type(docs)
                snapshot.damaged = True
                continue
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
        """The version counter; 0 where it is missing or holds no count (Redis lost it)."""
        try:
            return _count(await self.client.get(self._version)) or 0
        except ResponseError as exc:
            _raise_unless_wrong_type(exc)
            return 0

    async def touch(self, last_used: dict[str, float]) -> None:
        if last_used:
            args = [item for key_id, at_s in last_used.items() for item in (key_id, repr(at_s))]
            await self._touch(keys=[self._last_used], args=args)

    async def last_used(self) -> dict[str, float]:
        try:
            found = await self.client.hgetall(self._last_used)
        except ResponseError as exc:
            _raise_unless_wrong_type(exc)
            return {}
        times = {_text(k): stored_number(v) for k, v in found.items()}
        return {key_id: at_s for key_id, at_s in times.items() if at_s is not None}

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
                words = _text(message["data"]).split(" ", 2)
                count = _count(words[0]) if len(words) == 3 else None
                if count is not None and words[1] in KINDS:  # else not one of ours: the version poll repairs
                    yield Change(count, words[1], words[2])
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]

    async def close(self) -> None:
        await self.client.aclose()


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _count(value: bytes | str | None) -> int | None:
    """A version counter as Redis's INCR writes it (decimal digits, within 64 bits), else None."""
    text = _text(value) if value is not None else ""
    return int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None


def _damage(exc: Exception) -> bool:
    """Whether a script's error is Redis holding what no replica writes: a key of another type, or a
    version counter that is no count (INCR's error)."""
    return "WRONGTYPE" in str(exc) or "not an integer" in str(exc)


def _raise_unless_wrong_type(exc: Exception) -> None:
    """A key of another type is damage the caller repairs; any other error is Redis's, raised."""
    if not str(exc).startswith("WRONGTYPE"):
        raise exc


log = logging.getLogger(__name__)


class MirroredDirectoryStore:
    name = "redis+sqlite"

    def __init__(
        self, primary: RedisDirectoryStore, copy: SqliteDirectoryStore | None, damaged: KeyStoreDamaged | None = None
    ) -> None:
        self.primary = primary
        self.copy = copy  # None while the file at start-up was damaged (`damaged`) and Redis not yet read
        self.damaged = damaged
        self.restored = 0  # how many times this replica put the copy back into an empty Redis
        self.rebuilt = 0  # how many times a damaged copy was set aside and written again from Redis

    @classmethod
    def beside(cls, primary: RedisDirectoryStore, path: str | Path) -> MirroredDirectoryStore:
        """Redis with the SQLite copy at `path`. A copy that cannot be read is no reason to refuse
        start-up while Redis holds the store: `load` sets it aside and writes it again from Redis.
        Only when Redis holds nothing either does start-up stop with the copy's one line."""
        try:
            return cls(primary, SqliteDirectoryStore(path))
        except KeyStoreDamaged as exc:
            return cls(primary, None, exc)

    async def load(self) -> Snapshot:
        snapshot = await self.primary.load()
        if self.damaged is not None:  # start-up only: the file moved and opened off the loop
            await asyncio.to_thread(self._rebuild_copy, snapshot)
        assert self.copy is not None
        if snapshot.damaged or (snapshot.version == 0 and not any(snapshot.docs.values())):
            kept = await self.copy.load()
            if snapshot.damaged or any(kept.docs.values()):
                if await self.primary.restore(kept):
                    self.restored += 1
                    counts = ", ".join(f"{len(docs)} {kind}(s)" for kind, docs in kept.docs.items())
                    what = "damaged" if snapshot.damaged else "empty"
                    log.warning("the key store in Redis was %s: restored %s from %s", what, counts, self.copy.path)
                snapshot = await self.primary.load()
                return snapshot  # the copy already holds it (or another replica's, which came from the same)
        await self._keep(self.copy.replace_all(snapshot))
        return snapshot

    async def write(self, kind: Kind, name: str, doc: str | None) -> int:
        if await self.primary.version() == 0:  # Redis lost everything and no reload restored it yet:
            await self.load()  # restore first, so this write does not start a new, empty history
        try:
            version = await self.primary.write(kind, name, doc)
        except ResponseError as exc:  # Redis holds what no replica wrote there (a version that is no
            if not _damage(exc):  # count, documents of another type): repaired from the copy, once
                raise
            await self.load()
            version = await self.primary.write(kind, name, doc)
        if self.copy is not None:
            await self._keep(self.copy.put(kind, name, doc, version))
        return version

    async def fetch(self, kind: Kind, name: str) -> str | None:
        """Another replica's write, as announced: applied here, so kept here too."""
        doc = await self.primary.fetch(kind, name)
        if self.copy is not None:
            await self._keep(self.copy.put(kind, name, doc, None))
        return doc

    async def version(self) -> int:
        return await self.primary.version()

    async def touch(self, last_used: dict[str, float]) -> None:
        await self.primary.touch(last_used)
        if self.copy is not None:
            await self._keep(self.copy.touch(last_used))

    async def last_used(self) -> dict[str, float]:
        found = await self.copy.last_used() if self.copy is not None else {}
        for key_id, at_s in (await self.primary.last_used()).items():
            found[key_id] = max(at_s, found.get(key_id, 0.0))
        return found

    def changes(self) -> AsyncIterator[Change] | None:
        return self.primary.changes()

    async def close(self) -> None:
        try:
            await self.primary.close()
        finally:
            if self.copy is not None:
                await self.copy.close()

    def _rebuild_copy(self, snapshot: Snapshot) -> None:
        """The copy was damaged at start-up: with Redis holding the store, the file is set aside
        (`<name>.corrupt-<n>`, kept for the operator) and a new one is written from Redis by `load`;
        with Redis empty or damaged too, nothing holds the keys: start-up stops, the file untouched."""
        damaged = self.damaged
        assert damaged is not None
        if snapshot.damaged or (snapshot.version == 0 and not any(snapshot.docs.values())):
            raise damaged
        try:
            aside = set_aside(damaged.path)
        except OSError as exc:
            log.warning("the local copy of the key store %s cannot be set aside (%s)", damaged.path, exc)
            raise damaged from None
        self.copy = SqliteDirectoryStore(damaged.path)
        self.damaged = None
        self.rebuilt += 1
        log.warning(
            "the local copy of the key store %s could not be read (%s): set aside as %s and written again from Redis",
            damaged.path,
            damaged.why,
            aside,
        )

    async def _keep(self, step: Awaitable[None]) -> None:
        try:
            await step
        except Exception as exc:
            path = self.copy.path if self.copy is not None else "-"
            log.warning("writing the local copy of the key store (%s) failed: %s", path, exc)

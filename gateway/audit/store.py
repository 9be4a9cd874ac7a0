"""The audit log: one record per admin change, appended and fsync'd one at a time, rotated by size,
read back newest first.

## One record (`Change`, `encode`, `decode`)

One audit record: who changed what through the admin API, when, and the object before and after.

A record is one JSON line, self-describing (`kind`, `v`) so it can share a sink with the usage
ledger's lines (the Redis stream) without being mistaken for one. Fields:

    kind      "admin_change"
    v         1 (the format's version)
    time, ts  when it was recorded: UTC ISO-8601 with milliseconds, and unix seconds
    actor     how the caller authenticated: "admin-token", "console:<session id>", "loopback"
    client    the peer address of the connection (never a forwarded header: proxies are not trusted)
    method    POST, PUT, PATCH or DELETE
    route     the route's template ("/admin/keys/{key_id}"), so records group without parsing paths
    action    "METHOD route", what the `action` filter of `GET /admin/audit` matches
    target    the changed object's id (the handler's, else the path's), or null
    status    the HTTP status the change was answered with
    before, after   the object as the handler saw it, or null where it did not say
    request_id      the caller's `x-request-id` when it is 1-128 visible ASCII characters

Text a client sent (a path id, a header) that is not valid UTF-8 is written with replacement
characters (gateway/client_text.py): a change that was made is always recorded.

Secrets never reach a record: every field whose name says it holds one (`secret`, `sha256`, `token`,
...) is replaced by "[redacted]" at any depth, whatever the handler passed, so a handler that hands
over a whole reply by mistake still writes no key. An oversized object is replaced by a note
rather than making a line no reader can page through.

## The files (`AuditLog`)

The audit files: appended and fsync'd one change at a time, rotated by size, read back newest first.

Admin changes are rare (an operator's clicks, a deploy script), so each `append` writes its line and
fsyncs before it returns: the admin guard awaits it in a worker thread before the answer leaves, so
a change the caller was told about is on disk, and survives `kill -9` and power loss. This is the
opposite trade of the usage ledger's group commit (gateway/ledger/writer.py), made for the opposite
rate.

Files: `PREFIX.jsonl` is written; past `rotate_bytes` it becomes `PREFIX.jsonl.1`, the previous `.1`
becomes `.2`, and so on up to `keep_files`; older ones are deleted. The disk held is therefore at
most `(keep_files + 1) * rotate_bytes`. A crash can leave a torn last line only in a write whose
answer never left; the next start ends that line before appending, and readers skip it.

Processes of one host may share the directory (the workers of `server.workers`, replicas on one
machine): each append holds an exclusive `flock` on `PREFIX.lock` while it checks the size, rotates,
writes and fsyncs, and reopens the file when another process rotated it away. The time of each
record is taken under that lock, so a file is in time order and a reader looking for `since` stops
at the first older record. Hosts that share a network filesystem keep a directory each (`flock`
there is not to be relied on).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import orjson

from backends.files import set_aside
from gateway.app.settings import AuditConfig
from gateway.client_text import json_line, valid_request_id
from gateway.ledger.reader import bounded_lines

KIND = "admin_change"
VERSION = 1
REDACTED = "[redacted]"
MAX_DEPTH = 12
MAX_LINE_BYTES = 64 * 1024  # a key or tenant view is ~1 KiB; metadata is bounded by the API's schema
MAX_TEXT_CHARS = 256  # a target id or request id echoed from the request, bounded

_SECRET_NAMES = frozenset(
    {"secret", "secrets", "sha256", "hash", "digest", "token", "password", "api_key", "apikey", "authorization",
     "admin_token", "csrf_token", "cookie", "previous"}
)  # fmt: skip
_SECRET_SUFFIXES = ("_secret", "_sha256", "_hash", "_digest", "_token", "_password")


@dataclass(frozen=True, slots=True)
class Change:
    """What the admin guard knows of one successful change, before it is stamped with a time."""

    actor: str
    client: str | None
    method: str
    route: str
    status: int
    target: str | None = None
    before: Any = None
    after: Any = None
    request_id: str | None = None


def is_secret_name(name: object) -> bool:
    lowered = str(name).lower()
    return lowered in _SECRET_NAMES or lowered.endswith(_SECRET_SUFFIXES)


def redact(value: Any, depth: int = 0) -> Any:
    """A JSON-able copy of `value` with every secret-named field replaced by REDACTED."""
    if depth > MAX_DEPTH:
        return "[too deep]"
    if isinstance(value, dict):
        return {str(k): REDACTED if is_secret_name(k) else redact(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, depth + 1) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)  # anything else a handler passed: its text, never a failure to record


def _bounded(text: str | None) -> str | None:
    return None if text is None else text[:MAX_TEXT_CHARS]


def stamp(change: Change, now_s: float) -> dict[str, Any]:
    """The record of `change` made at `now_s` (unix seconds)."""
    when = datetime.fromtimestamp(now_s, UTC)
    record: dict[str, Any] = {
        "kind": KIND,
        "v": VERSION,
        "time": when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z",
        "ts": round(now_s, 6),
        "actor": change.actor,
        "client": change.client,
        "method": change.method,
        "route": change.route,
        "action": f"{change.method} {change.route}",
        "target": _bounded(change.target),
        "status": change.status,
        "before": redact(change.before),
        "after": redact(change.after),
    }
    request_id = valid_request_id(change.request_id)
    if request_id:
        record["request_id"] = request_id
    return record


def encode(record: dict[str, Any]) -> bytes:
    """One line, newline-terminated. Past MAX_LINE_BYTES the objects give way to a note: the change
    is still recorded, who and what and when, only its contents are not."""
    line = json_line(record)
    if len(line) <= MAX_LINE_BYTES:
        return line
    note = f"omitted: the record was {len(line)} bytes (limit {MAX_LINE_BYTES})"
    return json_line({**record, "before": note, "after": note})


def decode(line: bytes) -> dict[str, Any] | None:
    """A record of an audit file, or None for a line that is not one (a torn last line of a crash)."""
    try:
        found = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(found, dict) or found.get("kind") != KIND or not isinstance(found.get("ts"), int | float):
        return None
    return found


log = logging.getLogger("tokenway.audit")

MAX_LIMIT = 1000
DEFAULT_LIMIT = 100


class LineSink(Protocol):
    """Where each written line is copied (the ledger's Redis stream exporter); must not block."""

    def submit(self, lines: Sequence[bytes]) -> None: ...
    def stats(self) -> dict[str, float]: ...
    def close_sync(self, timeout_s: float = 5.0) -> None: ...


@dataclass(frozen=True, slots=True)
class Query:
    """Filters of `GET /admin/audit`; every one optional but the bounded `limit`."""

    since_s: float | None = None
    actor: str | None = None  # "console" matches every console session, "console:ab12…" one of them
    action: str | None = None  # a case-insensitive part of "METHOD route" ("keys", "DELETE /admin/keys")
    target: str | None = None
    limit: int = DEFAULT_LIMIT
    visible: Callable[[dict[str, Any]], bool] | None = None  # a team admin's reach (gateway/http/team_scope.py)

    def matches(self, record: dict[str, Any]) -> bool:
        if self.visible is not None and not self.visible(record):
            return False
        actor = str(record.get("actor", ""))
        if self.actor is not None and actor != self.actor and not actor.startswith(self.actor + ":"):
            return False
        if self.action is not None and self.action.lower() not in str(record.get("action", "")).lower():
            return False
        return self.target is None or record.get("target") == self.target


class AuditLog:
    def __init__(
        self, config: AuditConfig, *, sink: LineSink | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config
        self.dir = Path(config.dir).resolve()  # relative to the working directory (docs/governance.md)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"{config.file_prefix}.jsonl"
        self._rotated_re = re.compile(rf"^{re.escape(config.file_prefix)}\.jsonl\.(\d+)$")
        self._sink = sink
        self._clock = clock
        self._lock = threading.Lock()  # this process's threads; the flock orders processes
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self.written_total = 0
        self.errors_total = 0
        self.rotations_total = 0
        self._set_aside_unusable()

    def _set_aside_unusable(self) -> None:
        """At start: a file of the log that is no file (a directory in its place) or that this
        process may not read and write is moved to `<name>.corrupt-<n>` with one warning. Left where
        it is, it would fail every append: each admin change made and answered, but none recorded."""
        for path in [self.path, *(p for _, p in self._rotated())]:
            try:
                usable = path.is_file() and os.access(path, os.R_OK | os.W_OK)
            except OSError:
                usable = False
            if usable or not (path.exists() or path.is_symlink()):
                continue
            try:
                aside = set_aside(path)
            except OSError as exc:
                log.warning("audit log: %s cannot be used and cannot be set aside (%s)", path, exc)
                continue
            log.warning("audit log: %s is not a file this process can read and append to: set aside as %s", path, aside)

    # -- writing (blocking: from a worker thread) --------------------------------------------

    def append(self, change: Change) -> dict[str, Any]:
        """Stamp, write and fsync one change; returns the record. Raises OSError when the disk
        refuses (counted in `errors_total`), after which the next append reopens the file."""
        with self._lock:
            try:
                with self._flocked():
                    record = stamp(change, self._clock())
                    line = encode(record)
                    fd = self._current()
                    size = os.fstat(fd).st_size
                    if size and size + len(line) > self.config.rotate_bytes:
                        self._rotate()
                        fd = self._current()
                    view = memoryview(line)
                    written = 0
                    while written < len(line):
                        written += os.write(fd, view[written:])
                    os.fsync(fd)
            except OSError:
                self.errors_total += 1
                self._close()  # a half-written line is ended when the file is opened again
                raise
            self.written_total += 1
        if self._sink is not None:
            try:
                self._sink.submit([line])
            except Exception:
                log.exception("audit log: copying a record to the ledger's sink failed")
        return record

    def close(self) -> None:
        with self._lock:
            self._close()
        if self._sink is not None:
            self._sink.close_sync()

    def stats(self) -> dict[str, float]:
        own: dict[str, float] = {
            "written_total": self.written_total,
            "errors_total": self.errors_total,
            "rotations_total": self.rotations_total,
        }
        return {**own, **self._sink.stats()} if self._sink is not None else own

    @contextlib.contextmanager
    def _flocked(self) -> Iterator[None]:
        """The directory's writers take turns: an exclusive flock, released by the kernel if the
        holder dies (a `kill -9` mid-append blocks nobody)."""
        if self._lock_fd is None:
            self._lock_fd = os.open(self.dir / f"{self.config.file_prefix}.lock", os.O_RDWR | os.O_CREAT, 0o640)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _current(self) -> int:
        """The descriptor of the file now at `path` (under the flock): kept while it is still that
        file, reopened when another process rotated it away."""
        if self._fd is not None:
            try:
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    return self._fd
            except FileNotFoundError:
                pass
            self._close_file()
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        self._fd = fd
        if os.fstat(fd).st_size and not _ends_with_newline(self.path):
            os.write(fd, b"\n")  # end a line torn by a crash, so the next record starts clean
        if created:
            _fsync_dir(self.dir)
        return fd

    def _close_file(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _close(self) -> None:
        self._close_file()
        lock_fd, self._lock_fd = self._lock_fd, None
        if lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock_fd)

    def _rotate(self) -> None:
        """PREFIX.jsonl → .1 → .2 … up to keep_files (under the flock); older files are deleted."""
        self._close_file()
        keep = self.config.keep_files
        for index, path in self._rotated():
            if index >= keep:
                path.unlink(missing_ok=True)  # beyond the bound (or left by a larger keep_files)
        for index in range(keep - 1, 0, -1):
            older = self._numbered(index)
            if older.exists():
                os.replace(older, self._numbered(index + 1))
        os.replace(self.path, self._numbered(1))
        _fsync_dir(self.dir)
        self.rotations_total += 1

    def _numbered(self, index: int) -> Path:
        return self.dir / f"{self.path.name}.{index}"

    def _rotated(self) -> list[tuple[int, Path]]:
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := self._rotated_re.match(p.name))]
        return sorted(found)

    # -- reading (blocking: from a worker thread) --------------------------------------------

    def files_newest_first(self) -> list[Path]:
        rotated = [path for _, path in self._rotated()]
        return ([self.path] if self.path.exists() else []) + rotated

    def read(self, query: Query) -> tuple[list[dict[str, Any]], bool]:
        """The newest records matching `query`, newest first, and whether more match beyond `limit`."""
        found: list[dict[str, Any]] = []
        for record in self._newest_first():
            if query.since_s is not None and record["ts"] < query.since_s:
                break  # files are in time order: everything further is older still
            if not query.matches(record):
                continue
            if len(found) == query.limit:
                return found, True
            found.append(record)
        return found, False

    def _newest_first(self) -> Iterator[dict[str, Any]]:
        for path in self.files_newest_first():
            try:
                lines = self._lines_of(path)  # at most rotate_bytes, in a worker thread
            except OSError:
                continue  # rotated away between the listing and the read, or not readable: the others are
            for line in reversed(lines):
                if line.strip():
                    record = decode(line)
                    if record is not None:
                        yield record

    def _lines_of(self, path: Path) -> list[bytes]:
        """The lines of one file that can be records: none longer than `MAX_LINE_BYTES` (a longer one
        is passed over a chunk at a time), and only the last `rotate_bytes` of a file longer than the
        writer lets one grow (a damaged one), so a read holds at most what one file should."""
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            start = max(0, size - self.config.rotate_bytes - MAX_LINE_BYTES)
            fh.seek(start)
            lines = bounded_lines(fh, MAX_LINE_BYTES + 1)
            if start:
                next(lines, None)  # the rest of a line cut by the seek
            return [line for line in lines if isinstance(line, bytes)]


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1) == b"\n"


def _fsync_dir(path: Path) -> None:
    """Make a new or renamed file's directory entry durable (the file's own fsync does not cover it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)

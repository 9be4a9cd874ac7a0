"""The embedded batch store: files, batches and per-line progress on disk, for one gateway process.

    <dir>/LOCK                  flock'd by the process that owns the directory
    <dir>/files/<id>.json       a file's record; <id>.jsonl its bytes; <id>.idx its request spans
    <dir>/batches/<id>.json     a batch's record (rewritten atomically at each status change)
    <dir>/batches/<id>.wal      its results (`ResultLog`, below)
    <dir>/tmp/                  uploads and output files being written

Records (file, batch) are written to a temporary name, fsynced and renamed. The lines' progress and
their write-ahead result logs are the `ResultLog`'s; at start-up each unfinished batch's is read back.

What the directory holds is read as input (bench/chaos/disk_fuzz.py): a record goes through the same
strict validation as the Redis store's (`read_file_meta`, `read_batch_meta`), and one that is not a
record, or a file record whose bytes or line index are not the sizes it records, is set aside with
its pieces (`<name>.corrupt-<n>`, kept for the operator) in one warning while the others load. A line
whose stored bytes went away later reads as `line_unreadable`; a result log is read a record's head at
a time, so a damaged line of any length costs no memory.

## Per-line progress (`ResultLog`)

The embedded batch store's per-line progress: which lines of each running batch are free, claimed
or done, and the write-ahead log that makes a line done.

    <dir>/batches/<id>.wal      a batch's results, append-only: one `<header>\t<line>\n` per line done

`record` appends the results of every line finished since the last write, fsyncs the log once for
all of them (group commit) and only then answers, so a line counts as done only when its result
survives a crash. A batch's progress is read back from its log the first time it is asked for (at
start-up for each unfinished batch): its lines with a result are done, a torn last record (the crash
came mid-write) is cut off, and every other line is free to run again. `DiskBatchStore`
keeps the file and batch records beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import heapq
import logging
import os
import shutil
import stat
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, TypeVar

import orjson

from backends.files import set_aside
from gateway.batch.objects import FINISHED, BatchMeta, Counts, FileMeta, read_batch_meta, read_file_meta
from gateway.batch.store import LineResult, QuotaExceeded

log = logging.getLogger("tokenway.batch.disk")

_FREE, _CLAIMED, _OK, _FAILED, _RECORDING = 0, 1, 2, 3, 4


@dataclass(slots=True)
class _Progress:
    total: int
    state: bytearray
    queue: deque[int]
    deferred: list[tuple[float, int]] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)
    held: int = 0
    wal: IO[bytes] | None = None


class ResultLog:
    """The line protocol of `BatchStore` for one process: progress in memory, results in one
    append-only log per batch under `batches_dir`. `meta` finds a batch's record when its progress
    is first needed."""

    def __init__(self, batches_dir: Path, meta: Callable[[str], BatchMeta], *, fsync: bool) -> None:
        self.batches_dir = batches_dir
        self.fsync = fsync
        self._meta = meta
        self._progress: dict[str, _Progress] = {}
        self._pending: list[tuple[str, bytes, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._failing_since_s: float | None = None  # results writes failing since (monotonic); None: they work
        self._failure_logged_s = 0.0
        self._writer: asyncio.Task[None] | None = None
        self._closing = False

    def wal_path(self, batch_id: str) -> Path:
        return self.batches_dir / f"{batch_id}.wal"

    def has(self, batch_id: str) -> bool:
        return batch_id in self._progress

    def load(self, batch: BatchMeta) -> None:
        """Read the batch's progress back from its log (a batch that runs, or runs again)."""
        self._progress[batch.id] = self._read_progress(batch)

    def _read_progress(self, batch: BatchMeta) -> _Progress:
        state = bytearray(batch.total)
        counts = Counts()
        path = self.wal_path(batch.id)
        good = 0
        unreadable = 0
        try:
            with open(path, "rb") as fh:
                for head, length, ended in _record_heads(fh):
                    if not ended:
                        break  # torn: the crash came mid-write
                    good += length
                    found = _head_of(head)
                    if found is None:
                        unreadable += 1
                        continue
                    index, ok, usage = found
                    if 0 <= index < batch.total and state[index] == _FREE:
                        state[index] = _OK if ok else _FAILED
                        counts.add(ok, usage)
                size = os.fstat(fh.fileno()).st_size
            if unreadable:
                log.warning("batch %s: %d unreadable result records in %s skipped", batch.id, unreadable, path)
            if good < size:
                log.warning("batch %s: cut a torn result record off its log", batch.id)
                with open(path, "r+b") as fh:
                    fh.truncate(good)
        except FileNotFoundError:
            pass
        except OSError as exc:  # not a file (a directory in its place), unreadable: set aside, lines run again
            aside = set_aside(path)
            log.warning("batch %s: result log %s unreadable (%s): set aside as %s", batch.id, path, exc, aside)
            state = bytearray(batch.total)
            counts = Counts()
        queue = deque(i for i in range(batch.total) if state[i] == _FREE)
        return _Progress(batch.total, state, queue, counts=counts)

    def _of(self, batch_id: str) -> _Progress:
        progress = self._progress.get(batch_id)
        if progress is None:
            progress = self._progress[batch_id] = self._read_progress(self._meta(batch_id))
        return progress

    async def counts(self, batch_id: str) -> Counts:
        progress = self._progress.get(batch_id)
        return progress.counts if progress is not None else Counts()

    async def claim(self, batch_id: str, n: int) -> list[int]:
        """Up to `n` free lines (those whose deferral is over first); one process: a claim lasts until
        the line is recorded, deferred, or the process ends."""
        progress = self._of(batch_id)
        out: list[int] = []
        now = time.monotonic()
        deferred = progress.deferred
        while deferred and len(out) < n and deferred[0][0] <= now:
            _due, i = heapq.heappop(deferred)
            if progress.state[i] == _FREE:
                out.append(i)
        queue = progress.queue
        while queue and len(out) < n:
            i = queue.popleft()
            if progress.state[i] == _FREE:
                out.append(i)
        for i in out:
            progress.state[i] = _CLAIMED
        progress.held += len(out)
        return out

    async def defer(self, batch_id: str, indices: Collection[int], delay_s: float) -> None:
        progress = self._progress.get(batch_id)
        if progress is None:
            return
        due = time.monotonic() + delay_s
        for i in indices:
            if progress.state[i] != _CLAIMED:
                continue
            progress.state[i] = _FREE
            progress.held -= 1
            if delay_s <= 0:
                progress.queue.appendleft(i)
            else:
                heapq.heappush(progress.deferred, (due, i))

    async def record(self, batch_id: str, results: Sequence[LineResult]) -> list[bool]:
        progress = self._of(batch_id)
        fresh: dict[int, LineResult] = {}
        for r in results:
            if progress.state[r.index] in (_FREE, _CLAIMED) and r.index not in fresh:
                fresh[r.index] = r
        if not fresh:
            return [False] * len(results)
        before = {i: progress.state[i] for i in fresh}
        for i in fresh:
            progress.state[i] = _RECORDING
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def durable(done: asyncio.Future[None]) -> None:
            """Runs when the write ends, even if the caller was cancelled meanwhile."""
            ok = not done.cancelled() and done.exception() is None
            for i, r in fresh.items():
                if ok:
                    if before[i] == _CLAIMED:
                        progress.held -= 1
                    progress.state[i] = _OK if r.ok else _FAILED
                    progress.counts.add(r.ok, r.usage)
                else:  # not on disk: the line is not done
                    progress.state[i] = before[i]

        future.add_done_callback(durable)  # before the caller's own wake-up: states are set when it resumes
        self._pending.append((batch_id, b"".join(r.record() for r in fresh.values()), future))
        self._ensure_writer()
        self._wake.set()
        await asyncio.shield(future)
        return [r.index in fresh and fresh[r.index] is r for r in results]

    def _ensure_writer(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    async def _write_loop(self) -> None:
        while True:
            if not self._pending:  # checked before waiting: a wake-up set while writing is not lost
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            pending, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self._append, pending)
            except OSError as exc:  # a full disk: the results wait and are written when it is back
                if self._closing:  # not written: those lines are not done, and run again after the restart
                    _fail(pending, exc)
                    continue
                self._failing(exc)
                self._pending[:0] = pending  # first again, in their order
                await asyncio.sleep(_RETRY_S)
                continue
            except Exception as exc:
                log.exception("writing batch results failed")
                _fail(pending, exc)
                continue
            if self._failing_since_s is not None:
                log.warning("writing batch results works again after %.0f s", time.monotonic() - self._failing_since_s)
                self._failing_since_s = None
            for _batch, _data, future in pending:
                if not future.done():
                    future.set_result(None)

    def _failing(self, exc: OSError) -> None:
        """Log a disk that refuses the results once with its traceback, then a line a minute. Retried
        rather than failed: a line whose result was not written would run again, its engine call made
        (and billed) twice for one answer."""
        now = time.monotonic()
        if self._failing_since_s is None:
            self._failing_since_s = self._failure_logged_s = now
            log.exception("writing batch results failed; kept to try again every %.0f s", _RETRY_S)
        elif now - self._failure_logged_s >= _FAILURE_LOG_EVERY_S:
            self._failure_logged_s = now
            log.error("writing batch results still failing after %.0f s: %s", now - self._failing_since_s, exc.strerror)

    def _append(self, pending: list[tuple[str, bytes, asyncio.Future[None]]]) -> None:
        """Write `pending` to the results logs, all of it or none: a log the disk refused is cut back
        to its size before, so a retry never leaves a result in it twice or half of one."""
        touched: dict[str, IO[bytes]] = {}
        sizes: dict[str, int] = {}
        try:
            for batch_id, data, _future in pending:
                progress = self._progress[batch_id]
                if progress.wal is None:
                    progress.wal = open(self.wal_path(batch_id), "ab")  # noqa: SIM115 - kept open while it runs
                if batch_id not in sizes:
                    sizes[batch_id] = progress.wal.tell()
                touched[batch_id] = progress.wal
                progress.wal.write(data)
            for wal in touched.values():
                wal.flush()
                if self.fsync:
                    os.fsync(wal.fileno())
        except OSError:
            for batch_id, wal in touched.items():
                self._progress[batch_id].wal = None
                with contextlib.suppress(OSError):
                    wal.close()  # what it buffered may or may not reach the disk: cut off below
                with contextlib.suppress(OSError):
                    os.truncate(self.wal_path(batch_id), sizes[batch_id])
            raise

    async def held(self, batch_id: str) -> int:
        progress = self._progress.get(batch_id)
        return progress.held if progress is not None else 0

    async def unrecorded(self, batch_id: str) -> list[int]:
        progress = self._of(batch_id)
        return [i for i, s in enumerate(progress.state) if s in (_FREE, _CLAIMED)]

    async def results(self, batch_id: str) -> AsyncIterator[LineResult]:
        path = self.wal_path(batch_id)
        if batch_id in self._progress and self._progress[batch_id].wal is not None:
            await asyncio.to_thread(self._progress[batch_id].wal.flush)  # type: ignore[union-attr]
        spans = await asyncio.to_thread(_result_spans, path)
        if not spans:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            for start in range(0, len(spans), 256):
                chunk = spans[start : start + 256]
                for raw in await asyncio.to_thread(_pread_all, fd, chunk):
                    result = LineResult.read(raw)
                    if result is not None:  # its header read, its line not (damaged since): not a result
                        yield result
        finally:
            os.close(fd)

    async def drop_progress(self, batch_id: str) -> None:
        progress = self._progress.pop(batch_id, None)
        if progress is not None and progress.wal is not None:
            progress.wal.close()
        with contextlib.suppress(OSError):  # gone, or a directory a damage left (set aside at the next start)
            await asyncio.to_thread(self.wal_path(batch_id).unlink)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer
        for progress in self._progress.values():
            if progress.wal is not None:
                progress.wal.close()
                progress.wal = None


def _fail(pending: list[tuple[str, bytes, asyncio.Future[None]]], exc: BaseException) -> None:
    for _batch, _data, future in pending:
        if not future.done():
            future.set_exception(exc)


_RETRY_S: Final = 1.0  # a results write the disk refused is tried again this often
_FAILURE_LOG_EVERY_S: Final = 60.0


def _pread_all(fd: int, spans: list[tuple[int, int, int]]) -> list[bytes]:
    return [os.pread(fd, length, offset) for _index, offset, length in spans]


def _result_spans(path: Path) -> list[tuple[int, int, int]]:
    """(index, offset, length) of each line's first result record, in line order."""
    found: dict[int, tuple[int, int]] = {}
    offset = 0
    try:
        with open(path, "rb") as fh:
            for head, length, ended in _record_heads(fh):
                if not ended:
                    break
                parsed = _head_of(head)
                if parsed is not None and length <= MAX_RESULT_BYTES:
                    found.setdefault(parsed[0], (offset, length))
                offset += length
    except OSError:  # gone, or not a file any more: no results to read
        return []
    return [(i, *found[i]) for i in sorted(found)]


MAX_HEAD_BYTES: Final = 4096  # a result record's header (`{"i":…,"ok":…,"u":[…]}`) is under 100 bytes
# A result line is what the engine answered (an embeddings answer can be large), so no bound fits it
# short of the upstream client's own (gateway/upstream/client.py); a record past this is none the
# runner wrote, and is skipped rather than read into memory whole.
MAX_RESULT_BYTES: Final = 256 * 1024 * 1024


def _record_heads(fh: IO[bytes]) -> Iterator[tuple[bytes, int, bool]]:
    """(the first `MAX_HEAD_BYTES` of each record, its length, whether it ended with a newline) of a
    result log: a record is read a chunk at a time, so a line of any length costs no more memory than
    its head."""
    while True:
        head = fh.readline(MAX_HEAD_BYTES)
        if not head:
            return
        length = len(head)
        line = head
        while not line.endswith(b"\n"):
            line = fh.readline(_CHUNK)
            if not line:
                break
            length += len(line)
        yield head, length, line.endswith(b"\n")


def _head_of(head: bytes) -> tuple[int, bool, tuple[int, int, int]] | None:
    """(index, ok, usage) of a result record's head, or None when it is not a result record's."""
    header, tab, rest = head.partition(b"\t")
    if not tab or not rest.rstrip(b"\n"):
        return None
    try:
        data = orjson.loads(header)
        usage = data["u"]
        index, ok = data["i"], data["ok"]
        if not isinstance(index, int) or not isinstance(ok, bool) or isinstance(index, bool):
            return None
        counts = (int(usage[0]), int(usage[1]), int(usage[2]))
    except (ValueError, KeyError, TypeError, IndexError, OverflowError):
        return None
    return index, ok, counts


_CHUNK: Final = 1 << 20


MAX_RECORD_BYTES: Final = 1 << 20  # a file or batch record is under 2 KiB; the batch's `errors` are bounded


def _read_record(path: Path) -> bytes | None:
    """A record's bytes, or None when they cannot be (read past `MAX_RECORD_BYTES`, not a file,
    unreadable)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_RECORD_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= MAX_RECORD_BYTES else None


class StoreLocked(Exception):
    """Another process owns the batch directory (two gateways need `state: redis` to share batches)."""


M = TypeVar("M", FileMeta, BatchMeta)


def _copy(meta: M) -> M:
    """Records leave the store as copies: a caller's changes never reach it behind its back."""
    return type(meta).from_dict(meta.to_dict())


def _write_atomic(path: Path, data: bytes, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:  # a full disk: no half-written copy is left beside the record
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if fsync:
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


class DiskBatchStore:
    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        self.files_dir = root / "files"
        self.batches_dir = root / "batches"
        self.tmp_dir = root / "tmp"
        for folder in (self.files_dir, self.batches_dir, self.tmp_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self._lock = open(root / "LOCK", "a+b")  # noqa: SIM115 - held for the store's life
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise StoreLocked(f"{root} is used by another gateway process (use state: redis to share it)") from None
        self._files: dict[str, FileMeta] = {}
        self._batches: dict[str, BatchMeta] = {}
        self._lines = ResultLog(self.batches_dir, self._batches.__getitem__, fsync=fsync)
        self._spans: dict[str, array[int]] = {}
        self._usage: dict[str, list[int]] = {}  # tenant -> [files, bytes]
        self._seq = 0
        self._locks: set[str] = set()
        self._saving = asyncio.Lock()
        for tmp in self.tmp_dir.iterdir():  # uploads a crash left half-written
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._load()

    # --- start-up -----------------------------------------------------------------------------------
    def _load(self) -> None:
        """Every record back; one that is not a record (damaged, of another shape, its bytes or line
        index gone) is set aside with one warning: the others load, the gateway starts."""
        for path in sorted(self.files_dir.glob("*.json")):
            raw = _read_record(path)
            meta = read_file_meta(raw) if raw is not None else None
            problem = self._file_problem(path, meta)
            if problem is not None or meta is None:
                self.set_aside(path, f"not a file record ({problem or 'unreadable'})")
                continue
            self._files[meta.id] = meta
            self._count(meta, 1)
            self._seq = max(self._seq, meta.seq)
        for path in sorted(self.batches_dir.glob("*.json")):
            raw = _read_record(path)
            batch = read_batch_meta(raw) if raw is not None else None
            if batch is None or batch.id != path.stem:
                self.set_aside(path, "not a batch record")
                continue
            self._batches[batch.id] = batch
            self._seq = max(self._seq, batch.seq)
        for batch in self._batches.values():
            if batch.status in ("in_progress", "finalizing", "cancelling"):
                self._lines.load(batch)
            elif batch.finished:  # a crash after the final record, before the log was dropped
                with contextlib.suppress(OSError):
                    self._lines.wal_path(batch.id).unlink()

    def _file_problem(self, path: Path, meta: FileMeta | None) -> str | None:
        """Why a file record cannot serve (None when it can): its bytes and line index must be files
        of the sizes it records, or every line of it would be read wrong."""
        if meta is None:
            return "unreadable"
        if meta.id != path.stem:
            return f"its id {meta.id!r} is not its name's"
        try:
            content = self._file_path(meta.id, ".jsonl").stat()
            index = self._file_path(meta.id, ".idx").stat()
        except OSError as exc:
            return f"its bytes or line index: {exc.strerror or exc}"
        if not stat.S_ISREG(content.st_mode) or content.st_size != meta.bytes:
            return f"its bytes are {content.st_size}, not the {meta.bytes} recorded"
        if not stat.S_ISREG(index.st_mode) or index.st_size != 16 * meta.lines:
            return f"its line index is {index.st_size} bytes, not {16 * meta.lines}"
        return None

    def set_aside(self, record: Path, why: str) -> None:
        """A damaged record and the pieces named after it, moved aside in one warning."""
        moved = []
        for piece in sorted(record.parent.glob(record.stem + ".*")):
            if ".corrupt-" not in piece.name and piece.suffix in (".json", ".jsonl", ".idx", ".wal"):
                with contextlib.suppress(OSError):
                    moved.append(set_aside(piece).name)
        log.warning("batch store: %s is %s: set aside as %s", record, why, ", ".join(moved) or "(gone)")

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _count(self, meta: FileMeta, sign: int) -> None:
        usage = self._usage.setdefault(meta.tenant, [0, 0])
        usage[0] += sign
        usage[1] += sign * meta.bytes

    def _file_path(self, file_id: str, suffix: str) -> Path:
        return self.files_dir / f"{file_id}{suffix}"

    def scratch(self) -> Path:
        return self.tmp_dir

    async def lock(self, name: str, ttl_s: float) -> bool:
        if name in self._locks:
            return False
        self._locks.add(name)
        return True

    async def unlock(self, name: str) -> None:
        self._locks.discard(name)

    # --- files --------------------------------------------------------------------------------------
    async def add_file(self, meta: FileMeta, content: Path, spans: Sequence[int], *, limits: tuple[int, int]) -> None:
        max_files, max_bytes = limits
        files, used = self._usage.get(meta.tenant, [0, 0])
        if max_files and (files + 1 > max_files or used + meta.bytes > max_bytes):
            raise QuotaExceeded(
                f"tenant '{meta.tenant}' keeps {files} files of {used} bytes "
                f"(limits: {max_files} files, {max_bytes} bytes)"
            )
        meta.seq = self._next_seq()
        self._files[meta.id] = _copy(meta)  # reserved now: a concurrent upload sees it in the quota
        self._count(meta, 1)
        try:
            await asyncio.to_thread(self._write_file, meta, content, array("Q", spans))
        except BaseException:
            self._files.pop(meta.id, None)
            self._count(meta, -1)
            raise

    def _write_file(self, meta: FileMeta, content: Path, spans: array[int]) -> None:
        target = self._file_path(meta.id, ".jsonl")
        if content.parent == self.tmp_dir:
            if self.fsync:
                with open(content, "rb") as fh:
                    os.fsync(fh.fileno())
            os.replace(content, target)
        else:
            shutil.copyfile(content, target)
        _write_atomic(self._file_path(meta.id, ".idx"), spans.tobytes(), self.fsync)
        _write_atomic(self._file_path(meta.id, ".json"), orjson.dumps(meta.to_dict()), self.fsync)
        self._spans[meta.id] = spans

    async def get_file(self, file_id: str) -> FileMeta | None:
        found = self._files.get(file_id)
        return _copy(found) if found is not None else None

    async def list_files(self, owner: str) -> list[FileMeta]:
        mine = (_copy(f) for f in self._files.values() if f.owner == owner)
        return sorted(mine, key=lambda f: f.seq, reverse=True)

    async def delete_file(self, file_id: str) -> bool:
        meta = self._files.pop(file_id, None)
        if meta is None:
            return False
        self._count(meta, -1)
        self._spans.pop(file_id, None)
        await asyncio.to_thread(self._unlink_file, file_id)
        return True

    async def expired_files(self, now_s: float) -> list[str]:
        return [f.id for f in self._files.values() if f.expires_at is not None and f.expires_at <= now_s]

    def _unlink_file(self, file_id: str) -> None:
        for suffix in (".json", ".idx", ".jsonl"):  # the record first: a half-deleted file is gone
            with contextlib.suppress(OSError):
                self._file_path(file_id, suffix).unlink()

    def _spans_of(self, file_id: str) -> array[int]:
        spans = self._spans.get(file_id)
        if spans is None:
            spans = array("Q")
            data = self._file_path(file_id, ".idx").read_bytes()
            spans.frombytes(data[: len(data) - len(data) % 16])  # whole (offset, length) pairs only
            if len(self._spans) > 64:
                self._spans.pop(next(iter(self._spans)))
            self._spans[file_id] = spans
        return spans

    async def read_lines(self, file_id: str, indices: Sequence[int]) -> list[bytes]:
        return await asyncio.to_thread(self._read_lines, file_id, list(indices))

    def _read_lines(self, file_id: str, indices: list[int]) -> list[bytes]:
        """The lines' stored bytes; b"" for a line the store no longer holds (its bytes or index
        damaged since start-up), which the runner records as `line_unreadable`."""
        try:
            spans = self._spans_of(file_id)
            fd = os.open(self._file_path(file_id, ".jsonl"), os.O_RDONLY)
        except OSError:
            return [b""] * len(indices)
        try:
            size = os.fstat(fd).st_size
            out = []
            for i in indices:
                inside = 2 * i + 1 < len(spans) and spans[2 * i] + spans[2 * i + 1] <= size
                out.append(os.pread(fd, spans[2 * i + 1], spans[2 * i]) if inside else b"")
            return out
        except OSError:
            return [b""] * len(indices)
        finally:
            os.close(fd)

    async def content_bytes(self, file_id: str) -> int:
        try:
            return (await asyncio.to_thread(self._file_path(file_id, ".jsonl").stat)).st_size
        except FileNotFoundError:
            return 0

    async def content(self, file_id: str) -> AsyncIterator[bytes]:
        fh = await asyncio.to_thread(open, self._file_path(file_id, ".jsonl"), "rb")
        try:
            while chunk := await asyncio.to_thread(fh.read, _CHUNK):
                yield chunk
        finally:
            fh.close()

    # --- batches ------------------------------------------------------------------------------------
    async def add_batch(self, meta: BatchMeta) -> None:
        meta.seq = self._next_seq()
        self._batches[meta.id] = _copy(meta)
        await self._save(meta)

    async def _save(self, meta: BatchMeta) -> None:
        async with self._saving:  # one write at a time: the last one holds the latest state
            data = orjson.dumps(meta.to_dict())
            await asyncio.to_thread(_write_atomic, self.batches_dir / f"{meta.id}.json", data, self.fsync)

    async def get_batch(self, batch_id: str) -> BatchMeta | None:
        found = self._batches.get(batch_id)
        return _copy(found) if found is not None else None

    async def list_batches(self, owner: str) -> list[BatchMeta]:
        mine = (_copy(b) for b in self._batches.values() if b.owner == owner)
        return sorted(mine, key=lambda b: b.seq, reverse=True)

    async def tenant_batches(self, tenant: str) -> list[BatchMeta]:
        return sorted((_copy(b) for b in self._batches.values() if b.tenant == tenant), key=lambda b: b.seq)

    async def update_batch(self, batch_id: str, when: Collection[str], **changes: Any) -> BatchMeta | None:
        meta = self._batches.get(batch_id)
        if meta is None or meta.status not in when:
            return None
        for name, value in changes.items():
            setattr(meta, name, value)
        if meta.status == "in_progress" and not self._lines.has(batch_id):
            self._lines.load(meta)
        await self._save(meta)
        return _copy(meta)

    async def delete_batch(self, batch_id: str) -> None:
        self._batches.pop(batch_id, None)
        await self.drop_progress(batch_id)
        with contextlib.suppress(OSError):
            await asyncio.to_thread((self.batches_dir / f"{batch_id}.json").unlink)

    async def expired_batches(self, finished_before_s: float) -> list[str]:
        return [
            b.id for b in self._batches.values() if b.finished_at is not None and b.finished_at <= finished_before_s
        ]

    async def active_batches(self) -> list[str]:
        return [b.id for b in sorted(self._batches.values(), key=lambda b: b.seq) if b.status not in FINISHED]

    # --- lines: the result log's --------------------------------------------------------------------
    async def counts(self, batch_id: str) -> Counts:
        return await self._lines.counts(batch_id)

    async def claim(self, batch_id: str, n: int, lease_s: float) -> list[int]:
        return await self._lines.claim(batch_id, n)

    async def renew(self, batch_id: str, indices: Collection[int], lease_s: float) -> None:
        return None  # one process: a claim lasts until it is recorded, deferred, or the process ends

    async def defer(self, batch_id: str, indices: Collection[int], delay_s: float) -> None:
        await self._lines.defer(batch_id, indices, delay_s)

    async def record(self, batch_id: str, results: Sequence[LineResult]) -> list[bool]:
        return await self._lines.record(batch_id, results)

    async def held(self, batch_id: str) -> int:
        return await self._lines.held(batch_id)

    async def unrecorded(self, batch_id: str) -> list[int]:
        return await self._lines.unrecorded(batch_id)

    def results(self, batch_id: str) -> AsyncIterator[LineResult]:
        return self._lines.results(batch_id)

    async def drop_progress(self, batch_id: str) -> None:
        await self._lines.drop_progress(batch_id)

    async def close(self) -> None:
        await self._lines.close()
        self._lock.close()

"""The embedded batch store: files, batches and per-line progress on disk, for one gateway process.

    <dir>/LOCK                  flock'd by the process that owns the directory
    <dir>/files/<id>.json       a file's record; <id>.jsonl its bytes; <id>.idx its request spans
    <dir>/batches/<id>.json     a batch's record (rewritten atomically at each status change)
    <dir>/batches/<id>.wal      its results (`ResultLog`, below)
    <dir>/tmp/                  uploads and output files being written

Records (file, batch) are written to a temporary name, fsynced and renamed. The lines' progress and
their write-ahead result logs are the `ResultLog`'s; at start-up each unfinished batch's is read back.

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
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, TypeVar

import orjson

from gateway.batch.objects import FINISHED, BatchMeta, Counts, FileMeta
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
        if path.exists():
            good = 0
            with open(path, "rb") as fh:
                for raw in fh:
                    if not raw.endswith(b"\n"):
                        break  # torn: the crash came mid-write
                    try:
                        result = LineResult.parse(raw)
                    except (ValueError, KeyError, IndexError, TypeError):
                        log.error("batch %s: unreadable result record at byte %d: skipped", batch.id, good)
                        good += len(raw)
                        continue
                    good += len(raw)
                    if 0 <= result.index < batch.total and state[result.index] == _FREE:
                        state[result.index] = _OK if result.ok else _FAILED
                        counts.add(result.ok, result.usage)
            if good < path.stat().st_size:
                log.warning("batch %s: cut a torn result record off its log", batch.id)
                with open(path, "r+b") as fh:
                    fh.truncate(good)
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
            except Exception as exc:
                log.exception("writing batch results failed")
                for _batch, _data, future in pending:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for _batch, _data, future in pending:
                if not future.done():
                    future.set_result(None)

    def _append(self, pending: list[tuple[str, bytes, asyncio.Future[None]]]) -> None:
        touched: dict[str, IO[bytes]] = {}
        for batch_id, data, _future in pending:
            progress = self._progress[batch_id]
            if progress.wal is None:
                progress.wal = open(self.wal_path(batch_id), "ab")  # noqa: SIM115 - kept open while it runs
            progress.wal.write(data)
            touched[batch_id] = progress.wal
        for wal in touched.values():
            wal.flush()
            if self.fsync:
                os.fsync(wal.fileno())

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
                    yield LineResult.parse(raw)
        finally:
            os.close(fd)

    async def drop_progress(self, batch_id: str) -> None:
        progress = self._progress.pop(batch_id, None)
        if progress is not None and progress.wal is not None:
            progress.wal.close()
        with contextlib.suppress(FileNotFoundError):
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


def _pread_all(fd: int, spans: list[tuple[int, int, int]]) -> list[bytes]:
    return [os.pread(fd, length, offset) for _index, offset, length in spans]


def _result_spans(path: Path) -> list[tuple[int, int, int]]:
    """(index, offset, length) of each line's first result record, in line order."""
    found: dict[int, tuple[int, int]] = {}
    if not path.exists():
        return []
    offset = 0
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            header = raw.partition(b"\t")[0]
            try:
                index = int(orjson.loads(header)["i"])
            except (ValueError, KeyError, TypeError):
                offset += len(raw)
                continue
            found.setdefault(index, (offset, len(raw)))
            offset += len(raw)
    return [(i, *found[i]) for i in sorted(found)]


_CHUNK: Final = 1 << 20


class StoreLocked(Exception):
    """Another process owns the batch directory (two gateways need `state: redis` to share batches)."""


M = TypeVar("M", FileMeta, BatchMeta)


def _copy(meta: M) -> M:
    """Records leave the store as copies: a caller's changes never reach it behind its back."""
    return type(meta).from_dict(meta.to_dict())


def _write_atomic(path: Path, data: bytes, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
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
        for path in self.files_dir.glob("*.json"):
            try:
                meta = FileMeta.from_dict(orjson.loads(path.read_bytes()))
            except (OSError, ValueError, TypeError):
                log.exception("unreadable file record %s: skipped", path)
                continue
            self._files[meta.id] = meta
            self._count(meta, 1)
            self._seq = max(self._seq, meta.seq)
        for path in self.batches_dir.glob("*.json"):
            try:
                batch = BatchMeta.from_dict(orjson.loads(path.read_bytes()))
            except (OSError, ValueError, TypeError):
                log.exception("unreadable batch record %s: skipped", path)
                continue
            self._batches[batch.id] = batch
            self._seq = max(self._seq, batch.seq)
        for batch in self._batches.values():
            if batch.status in ("in_progress", "finalizing", "cancelling"):
                self._lines.load(batch)
            elif batch.finished:  # a crash after the final record, before the log was dropped
                with contextlib.suppress(FileNotFoundError):
                    self._lines.wal_path(batch.id).unlink()

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
            with contextlib.suppress(FileNotFoundError):
                self._file_path(file_id, suffix).unlink()

    def _spans_of(self, file_id: str) -> array[int]:
        spans = self._spans.get(file_id)
        if spans is None:
            spans = array("Q")
            spans.frombytes(self._file_path(file_id, ".idx").read_bytes())
            if len(self._spans) > 64:
                self._spans.pop(next(iter(self._spans)))
            self._spans[file_id] = spans
        return spans

    async def read_lines(self, file_id: str, indices: Sequence[int]) -> list[bytes]:
        return await asyncio.to_thread(self._read_lines, file_id, list(indices))

    def _read_lines(self, file_id: str, indices: list[int]) -> list[bytes]:
        spans = self._spans_of(file_id)
        fd = os.open(self._file_path(file_id, ".jsonl"), os.O_RDONLY)
        try:
            return [os.pread(fd, spans[2 * i + 1], spans[2 * i]) for i in indices]
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
        with contextlib.suppress(FileNotFoundError):
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

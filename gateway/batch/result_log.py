"""The embedded batch store's per-line progress: which lines of each running batch are free, claimed
or done, and the write-ahead log that makes a line done.

    <dir>/batches/<id>.wal      a batch's results, append-only: one `<header>\t<line>\n` per line done

`record` appends the results of every line finished since the last write, fsyncs the log once for
all of them (group commit) and only then answers, so a line counts as done only when its result
survives a crash. A batch's progress is read back from its log the first time it is asked for (at
start-up for each unfinished batch): its lines with a result are done, a torn last record (the crash
came mid-write) is cut off, and every other line is free to run again. `DiskBatchStore`
(gateway/batch/disk.py) keeps the file and batch records beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

import orjson

from backends.files import set_aside
from gateway.batch.objects import BatchMeta, Counts
from gateway.batch.store import LineResult

log = logging.getLogger("tokenway.batch.disk")

_CHUNK: Final = 1 << 20  # a damaged record past its head is read at most this much at a time

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
        except FileNotFoundError:  # no line finished yet (the log is made by the first write): all free
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

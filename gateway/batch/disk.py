"""The embedded batch store: files, batches and per-line progress on disk, for one gateway process.

    <dir>/LOCK                  flock'd by the process that owns the directory
    <dir>/files/<id>.json       a file's record; <id>.jsonl its bytes; <id>.idx its request spans
    <dir>/batches/<id>.json     a batch's record (rewritten atomically at each status change)
    <dir>/batches/<id>.wal      its results (`ResultLog`, below)
    <dir>/tmp/                  uploads and output files being written

Records (file, batch) are written to a temporary name, fsynced and renamed. The lines' progress and
their write-ahead result logs are the `ResultLog`'s (gateway/batch/result_log.py); at start-up each
unfinished batch's is read back.

What the directory holds is read as input (bench/chaos/disk_fuzz.py): a record goes through the same
strict validation as the Redis store's (`read_file_meta`, `read_batch_meta`), and one that is not a
record, or a file record whose bytes or line index are not the sizes it records, is set aside with
its pieces (`<name>.corrupt-<n>`, kept for the operator) in one warning while the others load. A line
whose stored bytes went away later reads as `line_unreadable`; a result log is read a record's head at
a time, so a damaged line of any length costs no memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import stat
from array import array
from collections.abc import AsyncIterator, Collection, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import orjson

from backends.files import set_aside
from gateway.batch.objects import FINISHED, BatchMeta, Counts, FileMeta, read_batch_meta, read_file_meta
from gateway.batch.result_log import ResultLog
from gateway.batch.store import LineResult, QuotaExceeded

log = logging.getLogger("tokenway.batch.disk")

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

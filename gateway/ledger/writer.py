"""The usage ledger writer: its line format, the lines appended from the event loop and
group-committed by a thread, and the spend it tallies per key.

`append(record)` encodes the record (a few µs of orjson) and puts the line in a list under a lock;
no I/O happens on the event loop. A writer thread wakes when the first record of a group arrives,
sleeps until that record is 80 % of `commit_interval_ms` old, then writes the whole group with one
`write` (a record is therefore in the file, and survives `kill -9` of the gateway, no later than one
commit interval after its append). A separate sync thread fsyncs behind it, so a slow disk delays
power-loss durability but never the group commits; `close()` writes, fsyncs and closes.

Files are `<prefix>-YYYYMMDD-NNN.jsonl` by UTC day of the commit, a new one per day, past
`rotate_bytes`, and at every start (so a torn last line of a crashed run is never appended to).

## The line format (`encode`, `decode`)

The usage ledger's line format: one JSON object per finished request, one line per object.

Field names are the ledger's own, decoupled from `RequestRecord`'s attributes, so files written
today stay readable whatever the dataclass becomes; `v` is the schema version. Readers must accept
unknown fields (newer writers) and missing optional ones (older writers).

v1 fields: v, ts (finish, unix s), started (arrival, unix s), request_id, api, tenant, key_id,
requested_model, model, served_model, fallback_from, fallback_reason, pool, endpoint,
prefill_endpoint, engine, stream, status, http_status, error_code, reject_reason, input_tokens
(includes cached), cached_input_tokens, output_tokens, usage_source, cost_usd, ttft_s, tpot_s,
duration_s, gateway_overhead_s, upstream_attempts, route_reason, pd_reason, kv_transfer_failed,
`batch_id` on the records of batch lines (Batch API); `base_model` on the records of requests for a
LoRA adapter (`model` is the adapter; docs/adapters.md); `program` on the records of requests that
name their agent program (docs/agents.md); `user` (the end user) and `tags` (a list) on the records
of requests that name them (docs/governance.md); `leg` and `continues` on the records of a stream that
failed over to a fallback model mid-answer (one record per leg, numbered from 1; `continues` is the
request id of the leg before, null on the first: docs/agents.md); cache_write_input_tokens,
cache_write_1h_input_tokens (part of input_tokens, apart from cached_input_tokens, the cache reads),
reasoning_tokens (part of output_tokens) and cache_saved_usd (the cost with no prompt cache, less
cost_usd; negative when writes cost more than reads saved) when any is non-zero; and `extra` when
the record carries any of: slo_class, slo_idle_admit, queue_ms, spill (why it went to an overflow
pool), engine (the engine's own per-request timings).

Beside request records the ledger holds one record of kind `outcome` per agent program that posted
how it ended (`gateway/http/outcome.py`): v, kind, ts, started, request_id, tenant, key_id, program,
success, value. Request reports skip them (`report.py`); `--by outcome` joins them (`outcomes.py`).

## The spend tally (`SpendTally`)

Told of every record the ledger accepted (`LedgerWriter.tally`), it sums each record's cost per
(period, period id, key) for the spend reconciliation (`reconcile.py`, which reads the sums); it
lives beside the writer that calls it on every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, Protocol

import orjson

from gateway.app.settings import LedgerConfig
from gateway.client_text import json_line
from gateway.request.record import RequestRecord
from policies.limits.memory_store import period_id

SCHEMA_VERSION = 1


def record_to_entry(r: RequestRecord) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "ts": round(r.started_at_unix_s + r.duration_s, 6),
        "started": round(r.started_at_unix_s, 6),
        "request_id": r.request_id,
        "api": r.api,
        "tenant": r.tenant,
        "key_id": r.key_id,
        "requested_model": r.requested_model,
        "model": r.model,
        "served_model": r.served_model,
        "fallback_from": r.fallback_from,
        "fallback_reason": r.fallback_reason,
        "pool": r.pool,
        "endpoint": r.endpoint,
        "prefill_endpoint": r.prefill_endpoint,
        "engine": r.engine,
        "stream": r.stream,
        "status": r.status,
        "http_status": r.http_status,
        "error_code": r.error_code,
        "reject_reason": r.reject_reason,
        "input_tokens": r.prompt_tokens,
        "cached_input_tokens": r.cached_tokens,
        "output_tokens": r.completion_tokens,
        "usage_source": r.usage_source,
        "cost_usd": r.cost_usd,
        "ttft_s": r.ttft_s,
        "tpot_s": r.tpot_s,
        "duration_s": r.duration_s,
        "gateway_overhead_s": r.gateway_overhead_s,
        "upstream_attempts": r.upstream_attempts,
        "route_reason": r.route_reason,
        "pd_reason": r.pd_reason,
        "kv_transfer_failed": r.kv_transfer_failed,
    }
    if r.cache_write_tokens or r.cache_write_1h_tokens or r.reasoning_tokens or r.cache_saved_usd:
        entry["cache_write_input_tokens"] = r.cache_write_tokens
        entry["cache_write_1h_input_tokens"] = r.cache_write_1h_tokens
        entry["reasoning_tokens"] = r.reasoning_tokens
        entry["cache_saved_usd"] = r.cache_saved_usd
    if r.batch_id is not None:
        entry["batch_id"] = r.batch_id
    if r.program is not None:
        entry["program"] = r.program
    if r.base_model is not None:
        entry["base_model"] = r.base_model
    if r.user is not None:
        entry["user"] = r.user
    if r.tags:
        entry["tags"] = list(r.tags)
    if r.leg:
        entry["leg"] = r.leg
        entry["continues"] = r.continues
    extra = _extra(r)
    if extra:
        entry["extra"] = extra
    return entry


def _extra(r: RequestRecord) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if r.slo_class:
        extra["slo_class"] = r.slo_class
    if r.slo_idle_admit:
        extra["slo_idle_admit"] = True
    if r.queue_ms is not None:
        extra["queue_ms"] = r.queue_ms
    if r.spill is not None:
        extra["spill"] = r.spill
    if r.engine_metrics:
        extra["engine"] = r.engine_metrics
    return extra


def encode(record: RequestRecord) -> bytes:
    """One ledger line, newline included. Unknown types in `extra` are written as strings; text that
    is not valid UTF-8 (a header's undecodable bytes) is written with replacement characters, so a
    request never goes unrecorded for what a client sent."""
    return json_line(record_to_entry(record), default=str)


def decode(line: bytes) -> dict[str, Any]:
    """One entry from a line (newline optional); raises ValueError when it is not a JSON object."""
    entry = orjson.loads(line)
    if not isinstance(entry, dict):
        raise ValueError("a ledger line must be a JSON object")
    return entry


log = logging.getLogger("tokenway.ledger")

_COMMIT_AT = 0.8  # fraction of the interval a group's first record waits; the rest covers the write
_ERROR_LOG_EVERY_S = 60.0  # a disk that keeps failing: one log line a minute


class BatchSink(Protocol):
    """Receives every committed group of lines (e.g. the Redis stream exporter). `submit` must not
    block; the writer closes the sink after its last commit and merges its stats into its own."""

    def submit(self, lines: Sequence[bytes]) -> None: ...
    def stats(self) -> dict[str, float]: ...
    def close_sync(self, timeout_s: float = 5.0) -> None: ...


class Tally(Protocol):
    """Told of every record the ledger accepted (not of those it dropped)."""

    def add(self, record: RequestRecord) -> None: ...


PERIODS: Final = ("day", "month")  # the budget periods a key's spend is tallied for


class SpendTally:
    """The cost the ledger accepted, per (period, period id) and key; bounded."""

    def __init__(self, max_keys: int = 10_000) -> None:
        self.max_keys = max_keys
        self.recorded: dict[tuple[str, int], dict[str, float]] = {}
        self.overflow: dict[tuple[str, int], float] = {}
        self.pending: dict[tuple[str, int, str], float] = {}  # not yet added to Redis's sums
        self.models: dict[str, str] = {}  # key -> the last model it used (to find its spend counters)

    def add(self, record: RequestRecord) -> None:
        key, cost = record.key_id, record.cost_usd
        if not key or not cost:
            return
        for period in PERIODS:
            pid = period_id(period, record.started_at_unix_s)
            sums = self.recorded.get((period, pid))
            if sums is None:
                sums = self.recorded[(period, pid)] = {}
                self._prune(period, pid)
            if key in sums or len(sums) < self.max_keys:
                sums[key] = sums.get(key, 0.0) + cost
                self.pending[(period, pid, key)] = self.pending.get((period, pid, key), 0.0) + cost
            else:
                self.overflow[(period, pid)] = self.overflow.get((period, pid), 0.0) + cost
        if key in self.models or len(self.models) < self.max_keys:
            self.models[key] = record.model

    def _prune(self, period: str, pid: int) -> None:
        """Keep this period and the one before it (a request that began before midnight)."""
        for old in [k for k in self.recorded if k[0] == period and k[1] < pid - 1]:
            del self.recorded[old]
            self.overflow.pop(old, None)

    def take_pending(self) -> dict[tuple[str, int, str], float]:
        pending, self.pending = self.pending, {}
        return pending


def file_name_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(\d{{8}})-(\d+)\.jsonl$")


class LedgerWriter:
    def __init__(
        self,
        config: LedgerConfig,
        *,
        sink: BatchSink | None = None,
        wall_clock_s: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.dir = Path(config.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._sink = sink
        # sums of the costs the ledger accepted, per key and budget period (gateway/ledger/reconcile.py)
        self.tally: Tally | None = None
        self._wall_clock_s = wall_clock_s
        self._interval_s = config.commit_interval_ms / 1000.0
        self._max_pending = config.max_pending_records
        self._name_re = file_name_re(config.file_prefix)

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._committed = threading.Condition(self._lock)
        self._pending: list[bytes] = []
        self._first_pending_s = 0.0
        self._flush_requested = False
        self._closing = False
        self._closed = False

        # owned by the writer thread
        self._fd: int | None = None
        self._path: Path | None = None
        self._day = ""
        self._size_bytes = 0
        self._carry = b""  # bytes of a group a failed write left unwritten (retried first)
        self._carry_lines: list[bytes] = []  # that group's lines, counted and handed on once written

        self._fd_lock = threading.Lock()  # the sync thread's fd vs. rotation
        self._sync_wanted = threading.Event()

        # counters (ints/floats written by one thread, read anywhere)
        self.appended_total = 0
        self.written_total = 0
        self.dropped_total = 0
        self.commits_total = 0
        self.write_errors_total = 0
        self._failing_since_s: float | None = None  # writes failing since (monotonic); None: they work
        self._error_logged_s = 0.0
        self.fsyncs_total = 0
        self.files_total = 0
        self.bytes_written_total = 0
        self.last_commit_seconds = 0.0

        self._writer = threading.Thread(target=self._run_writer, name="ledger-writer", daemon=True)
        self._syncer: threading.Thread | None = None
        if config.fsync:
            self._syncer = threading.Thread(target=self._run_syncer, name="ledger-fsync", daemon=True)
            self._syncer.start()
        self._writer.start()

    # -- event loop side ---------------------------------------------------------------------

    def append(self, record: RequestRecord) -> bool:
        """Queue one finished request. O(1), never blocks on I/O. False: dropped (counted)."""
        accepted = self.append_line(encode(record))
        if accepted and self.tally is not None:
            self.tally.add(record)  # what the ledger holds, per key and period (reconcile.py)
        return accepted

    def observe(self, record: RequestRecord) -> None:
        """`append` under the name the walk's record sinks are called by."""
        self.append(record)

    def append_line(self, line: bytes) -> bool:
        """Queue one already encoded line (ending in a newline); False when it was dropped."""
        with self._lock:
            if self._closing or len(self._pending) >= self._max_pending:
                self.dropped_total += 1
                if self.dropped_total == 1 or self.dropped_total % 10_000 == 0:
                    log.error("usage ledger dropped %d records (closed or disk too slow)", self.dropped_total)
                return False
            self.appended_total += 1
            self._pending.append(line)
            if len(self._pending) == 1:
                self._first_pending_s = time.monotonic()
                self._wake.notify()
        return True

    def stats(self) -> dict[str, float]:
        """Counters for `tokenway_ledger_*` (see GatewayMetrics.set_ledger_stats)."""
        own: dict[str, float] = {
            "appended_total": self.appended_total,
            "written_total": self.written_total,
            "dropped_total": self.dropped_total,
            "commits_total": self.commits_total,
            "write_errors_total": self.write_errors_total,
            "fsyncs_total": self.fsyncs_total,
            "files_total": self.files_total,
            "bytes_written_total": self.bytes_written_total,
            "pending_records": len(self._pending),
            "last_commit_seconds": self.last_commit_seconds,
        }
        return {**own, **self._sink.stats()} if self._sink is not None else own

    @property
    def current_path(self) -> Path | None:
        return self._path

    def flush_sync(self, timeout_s: float = 10.0) -> bool:
        """Commit what is queued now and wait until it is written; False on timeout."""
        with self._lock:
            target = self.appended_total
            self._flush_requested = True
            self._wake.notify()
            return self._committed.wait_for(lambda: self.written_total >= target or self._closed, timeout_s)

    async def flush(self, timeout_s: float = 10.0) -> bool:
        return await asyncio.to_thread(self.flush_sync, timeout_s)

    def close_sync(self, timeout_s: float = 30.0) -> None:
        """Write everything queued, fsync, close the file and stop the threads. Idempotent."""
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._writer.join(timeout_s)
        if self._syncer is not None:
            self._sync_wanted.set()
            self._syncer.join(timeout_s)
        if self._writer.is_alive():
            log.error("usage ledger writer did not finish within %.0f s", timeout_s)
        if self._sink is not None:
            self._sink.close_sync()

    async def close(self, timeout_s: float = 30.0) -> None:
        await asyncio.to_thread(self.close_sync, timeout_s)

    # -- writer thread ----------------------------------------------------------------------

    def _run_writer(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._pending and not self._carry and not self._closing and not self._flush_requested:
                        self._wake.wait()
                    if self._pending and not self._closing:
                        deadline = self._first_pending_s + self._interval_s * _COMMIT_AT
                        while not self._closing and not self._flush_requested:
                            remaining = deadline - time.monotonic()
                            if remaining <= 0:
                                break
                            self._wake.wait(remaining)
                    batch, self._pending = self._pending, []
                    self._flush_requested = False
                    closing = self._closing
                if batch or self._carry:
                    self._commit(batch)
                    if self._carry and not closing:
                        time.sleep(min(self._interval_s, 1.0))  # disk error: retry after a pause
                with self._lock:
                    self._committed.notify_all()
                if closing and not self._pending:
                    break
        finally:
            self._close_file()
            with self._lock:
                self._closed = True
                self._committed.notify_all()

    def _commit(self, batch: list[bytes]) -> None:
        started_s = time.monotonic()
        lines = self._carry_lines + batch
        data = self._carry + b"".join(batch)
        self._carry, self._carry_lines = b"", []
        written = 0
        try:
            self._rotate_if_needed(len(data))
            assert self._fd is not None
            view = memoryview(data)
            while written < len(data):
                written += os.write(self._fd, view[written:])
        except OSError as exc:
            self.write_errors_total += 1
            self._carry, self._carry_lines = data[written:], lines
            self._write_failed(exc)
            return
        finally:
            self._size_bytes += written
            self.bytes_written_total += written
        if self._failing_since_s is not None:
            log.warning(
                "usage ledger writes to %s work again after %.0f s; nothing queued meanwhile was lost",
                self._path,
                time.monotonic() - self._failing_since_s,
            )
            self._failing_since_s = None
        self.written_total += len(lines)
        self.commits_total += 1
        self.last_commit_seconds = time.monotonic() - started_s
        self._sync_wanted.set()
        if self._sink is not None and lines:
            try:
                self._sink.submit(lines)
            except Exception:
                log.exception("usage ledger sink failed")

    def _write_failed(self, exc: OSError) -> None:
        """Log a failing disk once with its traceback, then a line a minute while it keeps failing:
        the writer retries every second, and a full disk is not worth 3,600 tracebacks an hour
        (`write_errors_total` counts every try)."""
        now = time.monotonic()
        if self._failing_since_s is None:
            self._failing_since_s = self._error_logged_s = now
            log.exception("usage ledger write to %s failed; %d bytes kept for retry", self._path, len(self._carry))
        elif now - self._error_logged_s >= _ERROR_LOG_EVERY_S:
            self._error_logged_s = now
            log.error(
                "usage ledger writes to %s still failing after %.0f s (%s); %d bytes kept for retry",
                self._path,
                now - self._failing_since_s,
                exc.strerror or type(exc).__name__,
                len(self._carry),
            )

    def _rotate_if_needed(self, incoming_bytes: int) -> None:
        day = datetime.fromtimestamp(self._wall_clock_s(), UTC).strftime("%Y%m%d")
        fits = self._size_bytes == 0 or self._size_bytes + incoming_bytes <= self.config.rotate_bytes
        if self._fd is not None and day == self._day and fits:
            return
        self._close_file()
        self._open_file(day)
        if self.config.retain_days is not None:
            self._delete_expired(day)

    def _open_file(self, day: str) -> None:
        seq = 1 + max(
            (int(m.group(2)) for p in self.dir.iterdir() if (m := self._name_re.match(p.name)) and m.group(1) == day),
            default=0,
        )
        while True:
            path = self.dir / f"{self.config.file_prefix}-{day}-{seq:03d}.jsonl"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                break
            except FileExistsError:
                seq += 1  # another writer took it between the listing and the open
        _fsync_dir(self.dir)
        with self._fd_lock:
            self._fd, self._path, self._day, self._size_bytes = fd, path, day, 0
        self.files_total += 1

    def _close_file(self) -> None:
        with self._fd_lock:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            try:
                os.fsync(fd)
                self.fsyncs_total += 1
            except OSError:
                log.exception("usage ledger fsync of %s failed", self._path)
            os.close(fd)

    def _delete_expired(self, today: str) -> None:
        assert self.config.retain_days is not None
        cutoff = (datetime.strptime(today, "%Y%m%d") - timedelta(days=self.config.retain_days)).strftime("%Y%m%d")
        for path in self.dir.iterdir():
            m = self._name_re.match(path.name)
            if m and m.group(1) < cutoff:
                try:
                    path.unlink()
                    log.info("usage ledger: deleted %s (older than %d days)", path.name, self.config.retain_days)
                except OSError:
                    log.exception("usage ledger: could not delete %s", path)

    # -- sync thread ------------------------------------------------------------------------

    def _run_syncer(self) -> None:
        while True:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            if self._closed or (self._closing and not self._writer.is_alive()):
                return
            with self._fd_lock:
                if self._fd is None:
                    continue
                try:
                    os.fdatasync(self._fd)
                    self.fsyncs_total += 1
                except OSError:
                    log.exception("usage ledger fsync of %s failed", self._path)


def _fsync_dir(path: Path) -> None:
    """Make a new file's directory entry durable too (the file's own fsync does not cover it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory; the file is synced
            os.fsync(fd)
    finally:
        os.close(fd)

"""Reading the usage ledger back: entries of every rotated file of a directory, oldest file first.

A crash can leave the last line of a file cut short (a torn write); it is skipped with a warning, as
is any other line that is not a JSON object (the warning names file:line). A last line that is a
whole object and lacks only its newline is kept: no proper prefix of a JSON object is valid JSON. `since`/`until`
filter on the entry's finish time `ts`; whole files dated before `since` are not opened (a file's
date is the UTC day its records were committed, which is never before their finish day).

A damaged file costs only its damaged lines (bench/chaos/disk_fuzz.py): a line longer than any record
(`MAX_LINE_BYTES`) is skipped without being held whole, and a file that cannot be opened (unreadable,
gone since the listing) is skipped with a warning while the others are read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from gateway.ledger.writer import decode

log = logging.getLogger("tokenway.ledger")

_FILE_RE = re.compile(r"^(?P<prefix>.+)-(?P<day>\d{8})-(?P<seq>\d+)\.jsonl$")

Warn = Callable[[str], None]


@dataclass(slots=True)
class ReadStats:
    files: int = 0
    lines: int = 0
    entries: int = 0
    torn_lines: int = 0
    corrupt_lines: int = 0
    warnings: list[str] = field(default_factory=list)


MAX_LINE_BYTES = 1 << 20
"""The longest line read as a record. A record holds the gateway's own names and counts and a few
values from the request's headers (each at most `server.max_header_bytes`): a few KiB. A longer line
is none the writer wrote (a damaged file); it is skipped a chunk at a time, never held whole."""


def bounded_lines(f: IO[bytes], limit: int = MAX_LINE_BYTES) -> Iterator[bytes | int]:
    """The lines of `f` (with their newlines), each at most `limit` bytes; in place of a longer line,
    its length (an int), read past a chunk at a time so that memory stays within `limit`."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit:
            yield line
            continue
        skipped = len(line)
        while not line.endswith(b"\n"):
            line = f.readline(1 << 16)
            if not line:
                break
            skipped += len(line)
        yield skipped


def ledger_files(directory: str | Path, prefix: str | None = None) -> list[Path]:
    """Ledger files in commit order: by day, then sequence number (numerically), then prefix."""
    found: list[tuple[str, int, str, Path]] = []
    for path in Path(directory).iterdir():
        m = _FILE_RE.match(path.name)
        if m and path.is_file() and (prefix is None or m["prefix"] == prefix):
            found.append((m["day"], int(m["seq"]), m["prefix"], path))
    found.sort(key=lambda t: t[:3])
    return [t[3] for t in found]


def iter_entries(
    directory: str | Path,
    *,
    since_unix_s: float | None = None,
    until_unix_s: float | None = None,
    prefix: str | None = None,
    stats: ReadStats | None = None,
    warn: Warn | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Ledger entries (dicts, see writer.py) with `since <= ts < until`, one at a time (nothing is
    kept: the caller aggregates). `on_bytes(n)` is told every few thousand lines how many bytes were
    read since its last call (a progress bar)."""
    stats = stats if stats is not None else ReadStats()
    since_day = datetime.fromtimestamp(since_unix_s, UTC).strftime("%Y%m%d") if since_unix_s is not None else None

    def warning(message: str) -> None:
        stats.warnings.append(message)
        (warn or log.warning)(message)

    for path in ledger_files(directory, prefix):
        m = _FILE_RE.match(path.name)
        if since_day is not None and m is not None and m["day"] < since_day:
            continue
        try:
            f = path.open("rb")
        except OSError as exc:  # unreadable, or gone since it was listed: the other files still count
            warning(f"{path}: not read ({exc.strerror or exc})")
            continue
        stats.files += 1
        with f:
            lines: Iterable[bytes | int] = bounded_lines(f)
            if on_bytes is not None:
                lines = _counted(lines, on_bytes)
            yield from _file_entries(path, lines, since_unix_s, until_unix_s, stats, warning)


def files_in_window(directory: str | Path, since_unix_s: float | None, prefix: str | None = None) -> list[Path]:
    """The files `iter_entries` opens for a window starting at `since_unix_s` (to size a progress bar)."""
    since_day = datetime.fromtimestamp(since_unix_s, UTC).strftime("%Y%m%d") if since_unix_s is not None else None
    out = []
    for path in ledger_files(directory, prefix):
        m = _FILE_RE.match(path.name)
        if since_day is None or m is None or m["day"] >= since_day:
            out.append(path)
    return out


def _counted(lines: Iterable[bytes | int], on_bytes: Callable[[int], None], every: int = 4096) -> Iterator[bytes | int]:
    pending = 0
    for n, line in enumerate(lines, start=1):
        pending += line if isinstance(line, int) else len(line)
        if n % every == 0:
            on_bytes(pending)
            pending = 0
        yield line
    if pending:
        on_bytes(pending)


def _file_entries(
    path: Path,
    lines: Iterable[bytes | int],
    since_unix_s: float | None,
    until_unix_s: float | None,
    stats: ReadStats,
    warning: Warn,
) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(lines, start=1):
        if isinstance(line, int):
            stats.lines += 1
            stats.corrupt_lines += 1
            warning(f"{path}:{number}: a line of {line} bytes skipped (a record is at most {MAX_LINE_BYTES})")
            continue
        if not line.strip():
            continue
        stats.lines += 1
        try:
            entry = decode(line)
        except ValueError as exc:  # orjson.JSONDecodeError is a ValueError
            if not line.endswith(b"\n"):  # only the last line of a file can lack its newline
                stats.torn_lines += 1
                warning(f"{path}:{number}: torn last line ({len(line)} bytes, no newline) skipped")
            else:
                stats.corrupt_lines += 1
                warning(f"{path}:{number}: corrupt record skipped ({exc})")
            continue
        ts = entry.get("ts")
        if not isinstance(ts, int | float):
            stats.corrupt_lines += 1
            warning(f"{path}:{number}: record without a numeric ts skipped")
            continue
        if since_unix_s is not None and ts < since_unix_s:
            continue
        if until_unix_s is not None and ts >= until_unix_s:
            continue
        stats.entries += 1
        yield entry

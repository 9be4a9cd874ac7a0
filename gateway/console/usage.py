"""Spend and usage over a chosen range, from the ledger, for the console's usage page.

The same streaming report as `tokenway usage report` (bounded memory whatever the range), run in a
worker thread so a long range never stalls the event loop, plus the spend-over-time lines of the
plot. The records come from the ledger's Redis stream when there is one (`ledger.redis_stream`, or by
default with `state: redis` the state's own: `LedgerConfig.stream`): every replica's records, wherever
its files are; else from the ledger's files in this replica's directory (every worker writing
there). Stream entry ids are the time they were added in milliseconds, so the range is read with
XRANGE in chunks; the stream is capped (`maxlen`), so the answer says from when it covers
(`covers_since`) when the range starts before its oldest entry; delivery is at least once, so a
record seen again (same request id, among the last `DEDUPE_WINDOW`) is counted once.

## The CSV download (`csv_response`)

`GET /admin/usage?format=csv`: the usage report as a CSV file, for a spreadsheet or a script.

The same report as the JSON form (same range, grouping and, for a team admin, the same records),
its groups most expensive first, at most `MAX_CSV_ROWS` of them (a header says how many there were),
then a `TOTAL` row over every record. Numbers are written unformatted (full precision, no currency
sign), as the console's own export does.

A group's text comes from clients (a model name, a tag, an end user's id), and a spreadsheet runs a
cell that starts with `=`, `+`, `-` or `@` as a formula (OWASP, "CSV Injection"): such a text cell is
written with a leading `'`, which spreadsheets show as text. Numbers are the gateway's own and are
written as numbers.
"""

from __future__ import annotations

import asyncio
import csv
import io
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from gateway.app.settings import RedisStreamConfig
from gateway.ledger.cli import parse_time_s
from gateway.ledger.plot import SpendSeries
from gateway.ledger.reader import iter_entries
from gateway.ledger.report import METRIC_COLUMNS, ReportBuilder

MAX_GROUPS = 200  # rows returned to the page; the total still counts every record
STREAM_CHUNK = 5_000  # entries per XRANGE
DEDUPE_WINDOW = 100_000  # request ids remembered to count a re-delivered record once


def usage(
    directory: Path,
    since: str,
    until: str | None,
    by: list[str],
    top: int = 8,
    stream: RedisStreamConfig | None = None,
    keep: Callable[[dict[str, Any]], bool] | None = None,
    max_rows: int = MAX_GROUPS,
) -> dict[str, Any]:
    """The report of the records in [since, until] grouped `by`, its `max_rows` most expensive rows
    and the plot's lines; only the records `keep` keeps (a team admin's teams': gateway/http/team_scope.py)
    count, in the rows and the total alike."""
    now_s = time.time()
    since_s = parse_time_s(since, now_s)
    until_s = parse_time_s(until, now_s) if until else None
    builder = ReportBuilder(by)
    series = SpendSeries(by)
    found: dict[str, Any] = {"source": "files"}
    for entry in ledger_entries(directory, stream, since_s, until_s, found):
        if keep is not None and not keep(entry):
            continue
        builder.add(entry)
        series.add(entry)
    report = builder.report()
    found.pop("last_id", None)  # where an incremental reader would go on from: not the page's
    return {
        **found,
        "by": report.by,
        "since": since_s,
        "until": until_s if until_s is not None else now_s,
        "rows": report.rows()[:max_rows],
        "groups": len(report.groups),
        "total": report.total.metrics(),
        "series": {"bucket_s": series.bucket_s, "slots": series.slots(), "lines": series.lines(top)},
    }


def ledger_entries(
    directory: Path, stream: RedisStreamConfig | None, since_s: float, until_s: float | None, found: dict[str, Any]
) -> Iterable[dict[str, Any]]:
    """The ledger's entries in [since, until]: every replica's from the Redis stream when the ledger
    is copied there (`found` then says so, and from when it covers), else this replica's files."""
    if stream is not None:
        return _stream_entries(stream, since_s, until_s, found)
    if directory.is_dir():
        return iter_entries(directory, since_unix_s=since_s, until_unix_s=until_s, warn=lambda _: None)
    return ()


def _stream_entries(
    config: RedisStreamConfig, since_s: float, until_s: float | None, found: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """The ledger records of every replica in [since, until], read from the Redis stream in chunks."""
    return stream_entries(config, since_s, until_s, found)


def stream_entries(
    config: RedisStreamConfig,
    since_s: float,
    until_s: float | None,
    found: dict[str, Any],
    *,
    after: str | None = None,
    seen: OrderedDict[str, None] | None = None,
) -> Iterator[dict[str, Any]]:
    """The stream's records in [since, until], or, with `after` (an entry id read before), those added
    since: an incremental reader (tenant_spend.py) keeps the last id read in `found["last_id"]` and its
    `seen` request ids across calls, so a record delivered again later is still counted once.
    `found["covers_since"]` says from when the records are complete when the cap trimmed entries
    that were not read (before the range, or past `after`)."""
    import redis

    client = redis.Redis.from_url(config.url, socket_timeout=10.0, socket_connect_timeout=5.0)
    found["source"] = "redis-stream"
    seen = seen if seen is not None else OrderedDict()
    try:
        info: Any = client.xinfo_stream(config.stream) if client.exists(config.stream) else {}
        trimmed = int(info.get("entries-added", 0) or 0) > int(info.get("length", 0) or 0)  # Redis 7: ever added
        first = info.get("first-entry")
        if trimmed and first:
            first_ms = _id_ms(first[0])
            if after is not None:
                if _id_key(first[0]) > _id_key(after):  # the entry last read is gone: some after it may be too
                    found["covers_since"] = first_ms / 1000.0
            elif first_ms / 1000.0 > since_s:
                found["covers_since"] = first_ms / 1000.0  # the stream was trimmed (maxlen) after the range began
        start = "(" + after if after is not None else f"{int(since_s * 1000)}-0"
        end = f"{int(until_s * 1000)}-99999999" if until_s is not None else "+"
        while True:
            chunk: Any = client.xrange(config.stream, min=start, max=end, count=STREAM_CHUNK) or []
            for entry_id, fields in chunk:
                found["last_id"] = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                raw = (fields or {}).get(b"record")
                if raw is None:
                    continue
                entry = orjson.loads(raw)
                request_id = str(entry.get("request_id", ""))
                if request_id in seen:
                    continue
                seen[request_id] = None
                if len(seen) > DEDUPE_WINDOW:
                    seen.popitem(last=False)
                yield entry
            if len(chunk) < STREAM_CHUNK:
                return
            start = "(" + found["last_id"]
    finally:
        client.close()


def _id_ms(entry_id: bytes | str) -> int:
    """A stream entry id's milliseconds (`<ms>-<seq>`)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id (`<ms>-<seq>`) as a pair that sorts as Redis orders ids."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


async def usage_async(
    directory: Path,
    since: str,
    until: str | None,
    by: list[str],
    stream: RedisStreamConfig | None = None,
    keep: Callable[[dict[str, Any]], bool] | None = None,
    max_rows: int = MAX_GROUPS,
) -> dict[str, Any]:
    return await asyncio.to_thread(usage, directory, since, until, by, stream=stream, keep=keep, max_rows=max_rows)


MAX_CSV_ROWS = 10_000  # groups in one file; the TOTAL row still counts every record
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value: Any) -> Any:
    """A cell a spreadsheet shows as it is: text starting like a formula gets a leading quote."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def usage_csv(found: dict[str, Any]) -> str:
    """The rows and the total of a usage answer (gateway/console/usage.py) as CSV text."""
    by: list[str] = found["by"]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\r\n")  # RFC 4180's line end
    writer.writerow([*by, *METRIC_COLUMNS])
    for row in found["rows"]:
        writer.writerow([safe_cell(row.get(c)) for c in (*by, *METRIC_COLUMNS)])
    label = ["TOTAL", *[""] * (len(by) - 1)] if by else []
    writer.writerow([*label, *(safe_cell(found["total"].get(c)) for c in METRIC_COLUMNS)])
    return buf.getvalue()


def csv_response(found: dict[str, Any]) -> web.Response:
    """The CSV file as a download: its type, a file name of the time it was made (never of the
    request's text), and how many groups there were beside how many it holds."""
    name = time.strftime("tokenway-usage-%Y%m%dT%H%M%SZ.csv", time.gmtime())
    headers = {
        "Content-Type": "text/csv; charset=utf-8; header=present",
        "Content-Disposition": f'attachment; filename="{name}"',
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        "X-Tokenway-Usage-Groups": str(found["groups"]),
        "X-Tokenway-Usage-Rows": str(len(found["rows"])),
    }
    return web.Response(body=usage_csv(found).encode("utf-8"), headers=headers)

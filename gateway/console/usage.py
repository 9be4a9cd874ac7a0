"""Spend and usage over a chosen range, from the ledger, for the console's usage page.

The same streaming report as `tokenway usage report` (bounded memory whatever the range), run in a
worker thread so a long range never stalls the event loop, plus the spend-over-time lines of the
plot. Only this replica's ledger files are read (a shared ledger is the Redis stream's job).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from gateway.ledger.cli import parse_time_s
from gateway.ledger.plot import SpendSeries
from gateway.ledger.reader import iter_entries
from gateway.ledger.report import ReportBuilder

MAX_GROUPS = 200  # rows returned to the page; the total still counts every record


def usage(directory: Path, since: str, until: str | None, by: list[str], top: int = 8) -> dict[str, Any]:
    now_s = time.time()
    since_s = parse_time_s(since, now_s)
    until_s = parse_time_s(until, now_s) if until else None
    builder = ReportBuilder(by)
    series = SpendSeries(by)
    if directory.is_dir():
        for entry in iter_entries(directory, since_unix_s=since_s, until_unix_s=until_s, warn=lambda _: None):
            builder.add(entry)
            series.add(entry)
    report = builder.report()
    return {
        "by": report.by,
        "since": since_s,
        "until": until_s if until_s is not None else now_s,
        "rows": report.rows()[:MAX_GROUPS],
        "groups": len(report.groups),
        "total": report.total.metrics(),
        "series": {"bucket_s": series.bucket_s, "slots": series.slots(), "lines": series.lines(top)},
    }


async def usage_async(directory: Path, since: str, until: str | None, by: list[str]) -> dict[str, Any]:
    return await asyncio.to_thread(usage, directory, since, until, by)

"""`GET /admin/usage?format=csv`: the usage report as a CSV file, for a spreadsheet or a script.

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

import csv
import io
import time
from typing import Any

from aiohttp import web

from gateway.ledger.report import METRIC_COLUMNS

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

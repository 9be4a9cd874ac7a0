"""One audit record: who changed what through the admin API, when, and the object before and after.

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

Secrets never reach a record: every field whose name says it holds one (`secret`, `sha256`, `token`,
...) is replaced by "[redacted]" at any depth, whatever the handler passed, so a handler that hands
over a whole reply by mistake still writes no key. An oversized object is replaced by a note
rather than making a line no reader can page through.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

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
    if change.request_id:
        record["request_id"] = _bounded(change.request_id)
    return record


def encode(record: dict[str, Any]) -> bytes:
    """One line, newline-terminated. Past MAX_LINE_BYTES the objects give way to a note: the change
    is still recorded, who and what and when, only its contents are not."""
    line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
    if len(line) <= MAX_LINE_BYTES:
        return line
    note = f"omitted: the record was {len(line)} bytes (limit {MAX_LINE_BYTES})"
    return orjson.dumps({**record, "before": note, "after": note}, option=orjson.OPT_APPEND_NEWLINE)


def decode(line: bytes) -> dict[str, Any] | None:
    """A record of an audit file, or None for a line that is not one (a torn last line of a crash)."""
    try:
        found = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(found, dict) or found.get("kind") != KIND or not isinstance(found.get("ts"), int | float):
        return None
    return found

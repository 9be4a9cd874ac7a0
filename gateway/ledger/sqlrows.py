"""The `usage` table's columns, shared by the embedded SQLite store and the PostgreSQL sink.

One column per ledger field of codec.py, typed, so `sum(cost_usd)` and `WHERE tenant = 'acme'` need
no JSON functions; `extra` (a nested object) stays JSON text, and `other` holds, as one JSON object,
every field this version does not know (a newer writer's) plus any value whose type does not fit
its column (a string where a count belongs). Both stores therefore take every line a reader
accepts: a row is never refused for its content, so one odd record cannot stall a batch. A column
added here later is added to an existing table at the next ingest (older rows keep the field, if any,
in `other`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import orjson

Kind = Literal["int", "real", "text", "bool", "json"]

# (column, kind) in table order: the ledger fields of codec.py, then `other`.
COLUMNS: tuple[tuple[str, Kind], ...] = (
    ("v", "int"), ("ts", "real"), ("started", "real"), ("request_id", "text"), ("api", "text"),
    ("tenant", "text"), ("key_id", "text"), ("requested_model", "text"), ("model", "text"),
    ("served_model", "text"), ("fallback_from", "text"), ("fallback_reason", "text"), ("pool", "text"),
    ("endpoint", "text"), ("prefill_endpoint", "text"), ("engine", "text"), ("stream", "bool"),
    ("status", "text"), ("http_status", "int"), ("error_code", "text"), ("reject_reason", "text"),
    ("input_tokens", "int"), ("cached_input_tokens", "int"), ("output_tokens", "int"),
    ("cache_write_input_tokens", "int"), ("cache_write_1h_input_tokens", "int"), ("reasoning_tokens", "int"),
    ("usage_source", "text"), ("cost_usd", "real"), ("cache_saved_usd", "real"), ("ttft_s", "real"),
    ("tpot_s", "real"), ("duration_s", "real"), ("gateway_overhead_s", "real"), ("upstream_attempts", "int"),
    ("route_reason", "text"), ("pd_reason", "text"), ("kv_transfer_failed", "bool"), ("batch_id", "text"),
    ("program", "text"), ("user", "text"), ("tags", "json"), ("leg", "int"), ("continues", "text"),
    ("extra", "json"), ("other", "json"),
)  # fmt: skip
FIELDS = tuple(name for name, _ in COLUMNS[:-1])  # the ledger fields with a column of their own
_KNOWN = frozenset(FIELDS)

SQLITE_TYPES: dict[Kind, str] = {"int": "INTEGER", "real": "REAL", "text": "TEXT", "bool": "INTEGER", "json": "TEXT"}
POSTGRES_TYPES: dict[Kind, str] = {
    "int": "bigint",
    "real": "double precision",
    "text": "text",
    "bool": "boolean",
    "json": "jsonb",
}
# What the report groups and filters on most: time windows, tenants, keys, models.
INDEXED = ("ts", "tenant", "key_id", "model")


def _fits(kind: Kind) -> Callable[[Any], bool]:
    if kind == "int":
        return lambda v: isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
    if kind == "real":
        return lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    if kind == "text":
        return lambda v: isinstance(v, str)
    if kind == "bool":
        return lambda v: isinstance(v, bool)
    return lambda v: isinstance(v, dict | list)


_CHECKS = tuple((name, kind, _fits(kind)) for name, kind in COLUMNS[:-1])
_ALLOWED: dict[Kind, tuple[type, ...]] = {
    "int": (int,), "real": (int, float), "text": (str,), "bool": (bool,), "json": (dict, list),
}  # fmt: skip
_KINDS = tuple(kind for _, kind in COLUMNS[:-1])
_JSON_AT = tuple(i for i, kind in enumerate(_KINDS) if kind == "json")
_INT_AT = tuple(i for i, kind in enumerate(_KINDS) if kind == "int")
_SIGNATURES: dict[tuple[type, ...], bool] = {}  # the value types of a row -> every one fits its column
_MAX_SIGNATURES = 4096


def _signature_fits(signature: tuple[type, ...]) -> bool:
    fits = _SIGNATURES.get(signature)
    if fits is None:
        fits = all(t is type(None) or t in _ALLOWED[kind] for t, kind in zip(signature, _KINDS, strict=True))
        if len(_SIGNATURES) < _MAX_SIGNATURES:
            _SIGNATURES[signature] = fits
    return fits


def entry_to_sqlite_row(entry: dict[str, Any]) -> tuple[Any, ...]:
    """`entry_to_row` for SQLite, fast: a ledger line's value types follow a handful of patterns, so
    the check is one lookup of the row's type signature (the per-column checks run on a new pattern,
    an unknown field, or an integer past 64 bits); the rest is C-level `map`. The profile of
    bench/usage_sql put the per-column path at most of the loading time."""
    values = list(map(entry.get, FIELDS))
    if not _KNOWN.issuperset(entry) or not _signature_fits(tuple(map(type, values))):
        return entry_to_row(entry)
    for i in _INT_AT:
        v = values[i]
        if v is not None and not -(2**63) <= v < 2**63:
            return entry_to_row(entry)
    for i in _JSON_AT:
        if values[i] is not None:
            values[i] = orjson.dumps(values[i], default=str).decode()
    values.append(None)  # other
    return tuple(values)  # booleans bind as 0/1, integers in REAL columns are stored as REAL


def entry_to_row(entry: dict[str, Any], *, postgres: bool = False) -> tuple[Any, ...]:
    """One row, in COLUMNS order, from a decoded ledger entry. Booleans are 0/1 for SQLite; JSON is
    text; for PostgreSQL, NUL characters (which its text and jsonb refuse) become U+FFFD."""
    row: list[Any] = []
    other: dict[str, Any] | None = None
    for name, kind, fits in _CHECKS:
        value = entry.get(name)
        if value is None:
            row.append(None)
            continue
        if not fits(value):
            other = other if other is not None else {}
            other[name] = value
            row.append(None)
            continue
        if kind == "json":
            value = orjson.dumps(value, default=str).decode()
            if postgres and "\\u0000" in value:
                value = value.replace("\\u0000", "\\ufffd")  # jsonb refuses NUL, even escaped
        elif kind == "text":
            if postgres and "\x00" in value:
                value = value.replace("\x00", "\ufffd")  # so does text
        elif kind == "bool" and not postgres:
            value = int(value)
        elif kind == "real":
            value = float(value)
        row.append(value)
    unknown = {k: v for k, v in entry.items() if k not in _KNOWN}
    if unknown:
        other = {**(other or {}), **unknown}
    text = orjson.dumps(other, default=str).decode() if other else None
    if postgres and text is not None and "\\u0000" in text:
        text = text.replace("\\u0000", "\\ufffd")
    row.append(text)
    return tuple(row)

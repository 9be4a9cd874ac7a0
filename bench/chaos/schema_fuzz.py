"""Probe: schema-driven fuzz over the gateway's own OpenAPI document (hypothesis).

Every operation of `GET /openapi.json`, each request drawn from the operation's own request schema
and then mutated:

- auth: none, a wrong key, a file key, a key made through the admin API, another tenant's key, the
  admin token;
- path parameters: real ids (this probe's objects and another key's), or arbitrary text, traversal
  (`..`), percent-encoding;
- bodies: valid by the schema, then (most of the time) mutated in depth (a field nested up to 300
  levels), size (a field up to past the body bound), type (a field replaced by any JSON value) and
  encoding (gzip, truncated or doubled gzip, a `Content-Encoding` that lies, bytes that are not UTF-8,
  a byte-order mark, the wrong `Content-Type`); multipart uploads with any fields and any file bytes.

Targets, as in the rest of the chaos benchmark: no 5xx and no request left unanswered; afterwards no
reservation leaked (open tickets and leases in Redis), the budgets' spend equal to the ledger's sum of
`cost_usd`, and the gateway's RSS bounded.
"""

from __future__ import annotations

import gzip
import json
import random
import time
import urllib.parse
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from bench.chaos.common import ADMIN, KEY, MODEL, PREFIX, examples_block, fuzz_settings, unexpected_errors
from bench.chaos.fuzz import json_values
from bench.chaos.surfaces import (
    MAX_BODY,
    OTHER,
    Surfaces,
    batch_line,
    create_objects,
    multipart,
    nested,
    new_api_key,
    request,
    running,
    start_surfaces,
)
from gateway.http.openapi import resolve

MUTATIONS = ("none", "depth", "size", "type", "encoding", "encoding", "type")
HOSTILE_TEXT = st.sampled_from(
    ("..", "../..", "%2e%2e", "%00", "a" * 300, "file-x/../file-x", "%ff%fe", "~", "resp_" + "0" * 40, "")
) | st.text(min_size=1, max_size=40)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid by `schema`, for the JSON Schema the document's request bodies use (type,
    properties, required, additionalProperties, enum, const, oneOf, items and the numeric and length
    bounds). hypothesis-jsonschema would do it, but its last release does not run on the hypothesis
    this project installs."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        return st.one_of([from_schema(s) for s in schema["oneOf"]])
    kinds = schema.get("type", ["string", "integer", "number", "boolean", "null", "array", "object"])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return st.one_of([_typed(kind, schema) for kind in kinds])


def _typed(kind: str, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum")
        if kind == "integer":
            return st.integers(
                min_value=None if low is None else int(low) + ("exclusiveMinimum" in schema), max_value=high
            )
        return st.floats(
            min_value=low,
            max_value=high,
            exclude_min="exclusiveMinimum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 60), 60))
    if kind == "array":
        items = from_schema(schema["items"]) if "items" in schema else json_values
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
    properties: dict[str, Any] = schema.get("properties", {})
    required = [name for name in schema.get("required", ()) if name in properties]
    optional = [name for name in properties if name not in required]

    @st.composite
    def objects(draw: st.DrawFn) -> dict[str, Any]:
        chosen = (
            required + draw(st.lists(st.sampled_from(optional), unique=True, max_size=len(optional)))
            if optional
            else list(required)
        )
        value = {name: draw(from_schema(properties[name])) for name in chosen}
        extra = schema.get("additionalProperties", True)
        if extra is not False and draw(st.integers(0, 3)) == 0:
            values = from_schema(extra) if isinstance(extra, dict) else json_values
            value.update(draw(st.dictionaries(st.text(min_size=1, max_size=12), values, max_size=3)))
        return value

    return objects()


def _schema(doc: dict[str, Any], op: dict[str, Any], media: str) -> dict[str, Any] | None:
    content = op.get("requestBody", {}).get("content", {})
    if media not in content:
        return None
    found: dict[str, Any] = resolve(content[media]["schema"], doc)
    return found


def _mutate_json(draw: st.DrawFn, value: Any) -> tuple[bytes, dict[str, str]]:
    """A JSON body from `value` after one mutation; extra headers it needs."""
    kind = draw(st.sampled_from(MUTATIONS))
    obj = value if isinstance(value, dict) else {"value": value}
    field = draw(st.sampled_from(sorted(obj) or ["model"]))
    if kind == "depth":
        obj = {**obj, field: nested(draw(st.sampled_from((64, 200, 255, 300, 1000))))}
    elif kind == "size":
        size = draw(st.sampled_from((10_000, 200_000, MAX_BODY - 1000, MAX_BODY + 10_000)))
        obj = {**obj, field: "x" * size}
    elif kind == "type":
        obj = {**obj, field: draw(json_values)}
    raw = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    headers = {"Content-Type": "application/json"}
    if kind == "encoding":
        how = draw(st.sampled_from(("gzip", "gzip-truncated", "gzip-twice", "lies", "latin1", "bom", "type")))
        if how == "gzip":
            raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"
        elif how == "gzip-truncated":
            raw, headers["Content-Encoding"] = gzip.compress(raw)[:-6], "gzip"
        elif how == "gzip-twice":
            raw, headers["Content-Encoding"] = gzip.compress(gzip.compress(raw)), "gzip, gzip"
        elif how == "lies":
            headers["Content-Encoding"] = draw(st.sampled_from(("gzip", "deflate", "br", "x-bogus", "identity")))
        elif how == "latin1":
            raw = raw.replace(b'"', b'"\xff\xfe', 1)
        elif how == "bom":
            raw = b"\xef\xbb\xbf" + raw
        else:
            headers["Content-Type"] = draw(st.sampled_from(("text/plain", "application/x-www-form-urlencoded", "")))
    return raw, headers


@st.composite
def _files_body(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    fields = draw(
        st.dictionaries(
            st.sampled_from(("purpose", "expires_after[anchor]", "expires_after[seconds]", "x"))
            | st.sampled_from(("a\r\nb", "a\rb", "a\nb", "a\x00b", 'a"b', '"', "a\\"))  # part names a header breaks on
            | st.text(max_size=20),
            st.text(max_size=50),
            max_size=6,
        )
    )
    if draw(st.booleans()):
        fields["purpose"] = "batch"
    kind = draw(st.sampled_from(("lines", "lines", "bytes", "many-fields", "big-field")))
    data = batch_line() * draw(st.integers(1, 5))
    if kind == "bytes":
        data = draw(st.binary(max_size=500))
    elif kind == "many-fields":
        fields.update({f"f{n}": "v" for n in range(draw(st.sampled_from((50, 2000))))})
    elif kind == "big-field":
        fields["purpose"] = "x" * draw(st.sampled_from((5000, 300_000)))
    content_type, body = multipart(fields, data)
    return body, {"Content-Type": content_type}


def _credential(draw: st.DrawFn, api_secret: str) -> dict[str, str]:
    kind = draw(st.sampled_from(("none", "wrong", "key", "key", "api-key", "other", "admin")))
    token = {"wrong": "sk-wrong-0000", "key": KEY, "api-key": api_secret, "other": OTHER, "admin": ADMIN}.get(kind)
    if token is None:
        return {}
    if kind in ("key", "api-key") and draw(st.booleans()):
        return {"x-api-key": token}
    return {"Authorization": f"Bearer {token}"}


def _path(draw: st.DrawFn, template: str, real: dict[str, str]) -> str:
    def fill(name: str) -> str:
        if name in real and draw(st.integers(0, 3)) > 0:
            return real[name]
        return urllib.parse.quote(draw(HOSTILE_TEXT), safe="%./~")

    path = template
    for name in ("key_id", "name", "pool", "model", "file_id", "batch_id", "response_id"):
        if "{" + name + "}" in path:
            path = path.replace("{" + name + "}", fill(name))
    return path


def _query(draw: st.DrawFn, op: dict[str, Any]) -> str:
    params = [p for p in op.get("parameters", ()) if p["in"] == "query"]
    pairs = []
    for param in params:
        if draw(st.booleans()):
            value = draw(from_schema(param["schema"]) | HOSTILE_TEXT)
            pairs.append((param["name"], str(value)))
    return ("?" + urllib.parse.urlencode(pairs)) if pairs else ""


def _tenant_spend(s: Surfaces) -> float:
    """The spend the tenants' daily budgets hold (every request is under exactly one of them; a key
    with a budget of its own, which the fuzz may give an API-made key, counts the same spend again)."""
    client = s.redis.client()
    keys = client.scan_iter(match="{" + PREFIX + "}:u:tenant|usd_per_day|*")
    return sum(float(client.hget(k, "s") or 0.0) for k in keys)


def _settled(s: Surfaces, timeout_s: float = 60.0) -> tuple[dict[str, float], float]:
    """What Redis holds and the ledger's sum of `cost_usd` once both have stopped changing (batch
    lines the fuzz created run on spare capacity after it, and the ledger commits on an interval)."""
    deadline = time.monotonic() + timeout_s
    last: tuple[float, float] | None = None
    steady = 0
    while True:
        left = s.redis.leftovers()
        left["budget_usd"] = _tenant_spend(s)
        ledger_usd = sum(float(r.get("cost_usd") or 0.0) for r in s.stack.records())
        now = (left["budget_usd"], ledger_usd)
        idle = s.stack.inflight() == 0 and s.stack.pending_store_ops() == 0
        steady = steady + 1 if idle and now == last else 0
        if steady >= 4 or time.monotonic() > deadline:
            return left, ledger_usd
        last = now
        time.sleep(0.5)


def run(workdir: Path, *, examples: int = 2000, seed: int | None = None) -> dict[str, Any]:
    with running(start_surfaces(workdir)) as s:
        return fuzz(s, examples=examples, seed=seed)


def fuzz(s: Surfaces, *, examples: int, seed: int | None = None) -> dict[str, Any]:
    ops = s.operations()
    mine = create_objects(s)
    theirs = create_objects(s, OTHER)
    key_id, api_secret = new_api_key(s)
    real = {"key_id": key_id, "name": "bench", "pool": "llama", "model": MODEL, **mine}
    other_real = {**real, **theirs}
    statuses: dict[int, int] = {}
    by_route: dict[str, int] = {}
    errors: list[str] = []
    rss: list[int] = []
    started = time.monotonic()
    # warm-up: one valid request per inference route, then the RSS the bound is measured from
    for body_path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        request(
            s.main.port,
            "POST",
            body_path,
            {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            orjson.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "input": "hi",
                    "max_tokens": 2,
                    "max_output_tokens": 2,
                }
            ),
        )
    rss.append(s.stack.rss_bytes())

    @st.composite
    def requests(draw: st.DrawFn) -> tuple[str, str, str, dict[str, str], bytes]:
        method, template, op = draw(st.sampled_from(ops))
        path = _path(draw, template, draw(st.sampled_from((real, other_real)))) + _query(draw, op)
        headers = _credential(draw, api_secret)
        body = b""
        if (method, template) == ("POST", "/v1/files"):
            body, extra = draw(_files_body())
            headers.update(extra)
        else:
            schema = _schema(s.doc, op, "application/json")
            if schema is not None:
                value = draw(from_schema(schema))
                if isinstance(value, dict) and "model" in value and draw(st.integers(0, 3)) > 0:
                    value["model"] = MODEL  # most bodies reach the engines
                body, extra = _mutate_json(draw, value)
                headers.update(extra)
        if draw(st.integers(0, 5)) == 0:
            headers["x-request-id"] = draw(st.sampled_from(("same-id-for-all", "")) | st.text(max_size=20))
        return method, template, path, headers, body

    @fuzz_settings(examples, seed)
    @given(requests())
    def probe(sent: tuple[str, str, str, dict[str, str], bytes]) -> None:
        method, template, path, headers, body = sent
        status, _, raw = request(s.main.port, method, path, headers, body, timeout_s=60)
        statuses[status] = statuses.get(status, 0) + 1
        by_route[f"{method} {template}"] = by_route.get(f"{method} {template}", 0) + 1
        if status >= 500 or status == 0:
            errors.append(f"{status} {method} {path[:120]} {headers!r} {body[:160]!r} -> {raw[:160]!r}"[:700])
        if sum(statuses.values()) % 100 == 0:
            rss.append(s.stack.rss_bytes())

    random.seed(seed or 0)
    probe()
    left, ledger_usd = _settled(s)
    rss.append(s.stack.rss_bytes())
    log = s.main.log()
    return {
        "seed": seed,
        "examples": sum(statuses.values()),
        "operations": len(ops),
        "operations_hit": len(by_route),
        "statuses": dict(sorted(statuses.items())),
        "server_errors": len(errors),
        "server_error_examples": errors[:5],
        "unexpected_in_log": unexpected_errors(log),
        "tickets_left": int(left["tickets"]),
        "leases_left": int(left["leases"]),
        "inflight_left": s.stack.inflight(),
        "budget_usd": left["budget_usd"],
        "ledger_usd": ledger_usd,
        "rss_start_mb": rss[0] / 2**20,
        "rss_peak_mb": max(rss) / 2**20,
        "rss_end_mb": rss[-1] / 2**20,
        "seconds": round(time.monotonic() - started, 1),
    }


def seeded(r: dict[str, Any]) -> str:
    """How the report names the run's examples: the fixed sequence, or the seed that drew them."""
    return "" if r.get("seed") is None else f" (hypothesis seed {r['seed']})"


def section(r: dict[str, Any]) -> list[str]:
    statuses = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
    diff = r["budget_usd"] - r["ledger_usd"]
    growth = r["rss_end_mb"] - r["rss_start_mb"]
    leaks = r["tickets_left"] + r["leases_left"] + r["inflight_left"]
    ok5 = r["server_errors"] == 0 and r["unexpected_in_log"] == 0
    lines = [
        "## Schema-driven fuzz over /openapi.json (hypothesis)",
        "",
        f"{r['examples']} requests{seeded(r)} over {r['operations_hit']} of the document's {r['operations']} "
        "operations in "
        f"{r['seconds']:g} s: "
        "bodies drawn from each operation's request schema, then mutated in depth, size, type and encoding; "
        "no credentials, a wrong key, a file key, an API-made key, another tenant's key, the admin token; "
        f"real and hostile path ids. Answers by status: {statuses}.",
        "",
        "| 5xx or no answer | unexpected errors in the log | tickets left | leases left | in flight left | "
        "budget - ledger (USD) | RSS start / peak / end (MiB) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| {r['server_errors']} | {r['unexpected_in_log']} | {r['tickets_left']} | {r['leases_left']} | "
        f"{r['inflight_left']} | {diff:+.3g} | "
        f"{r['rss_start_mb']:.0f} / {r['rss_peak_mb']:.0f} / {r['rss_end_mb']:.0f} |",
        "",
        f"Targets: 0 5xx {'met' if ok5 else '**missed**'}; 0 leaked reservations "
        f"{'met' if leaks == 0 else '**missed**'}; budget - ledger = 0 {'met' if abs(diff) < 1e-9 else '**missed**'}; "
        f"RSS growth under 100 MiB {'met' if growth < 100 else '**missed**'} ({growth:+.0f} MiB).",
        "",
    ]
    return lines + examples_block(r["server_error_examples"], limit=100_000)

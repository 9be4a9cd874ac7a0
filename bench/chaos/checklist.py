"""Probe: the per-surface checklist, run for every operation of the gateway's OpenAPI document.

Each check is a promise some surface makes (docs/security.md, "Surfaces and the checks they pass");
an operation the promise does not concern gets `n.a.`. The operations come from the running
gateway's `GET /openapi.json`, so a new route is checked as soon as it is documented (and
tests/gateway/test_openapi.py fails while it is not).

- auth: no credentials, a wrong key and (admin routes) a valid API key are each refused (401/403).
- host: on the loopback gateway, an admin/console request naming `Host: rebind.attacker.example`, and
  one through a same-host proxy (`X-Forwarded-For`), are refused and get no session cookie.
- origin: a state-changing admin/console request with valid credentials from `Origin:
  http://evil.example`, `Sec-Fetch-Site: cross-site` gets 403.
- csrf: a state-changing admin request with the console cookie, same-origin, without the CSRF token,
  is refused.
- read_deadline: a body announced and never finished: the connection ends within
  request_read_timeout_s + 12 s.
- body_bound: a body over the route's bound gets 413 in the API's error shape.
- depth: a field nested 300 levels gets 400 in the API's error shape.
- owner_bounds: one key fills its store past its bound; another key's objects stay, and it can still
  store.
- rate_limit: a key with `rpm: 3` sends 6 requests: at least one 429 (login: 40 wrong tokens, at least
  one 429).
- ownership: another key asking for the id gets 404; a non-canonical path to it is not 200; a reused
  client-chosen `x-request-id` does not make the same id twice.
- one_record: an inference request, valid and invalid, each with its own `x-request-id`, leaves
  exactly one ledger record each.
- query_bytes: on a route with query parameters, its valid request with each parameter in turn set
  to values a parser may choke on (bytes that are not UTF-8, raw and percent-encoded, a NUL, 400
  digits, 10,000 characters, -1, nan, 1e309, a date out of range): answered, never a 5xx.
- header_bytes: the route's valid request, with its credentials, whose other headers the gateway
  reads (request id, session, program, user, tags, run caps, debug, CSRF, SLO, `tracestate`,
  `anthropic-version`, `User-Agent`) carry bytes that are not UTF-8: answered, and not with a 5xx (aiohttp hands such
  bytes over as lone surrogates, which fail whatever encodes them: a record, a digest, a forwarded
  header). A DELETE removes a fresh key, tenant or override, elsewhere a path id that does not
  exist, so the objects other checks use stay.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench.chaos.common import ADMIN, KEY, MODEL, until
from bench.chaos.surfaces import (
    EXAMPLES,
    MAX_BODY,
    MAX_FILE,
    OTHER,
    PER_KEY_RESPONSES,
    READ_TIMEOUT_S,
    TENANT_FILES,
    Op,
    Surfaces,
    admin_json,
    batch_line,
    bearer,
    create_objects,
    credentials,
    deep_json,
    error_shaped,
    example_request,
    multipart,
    new_api_key,
    path_values,
    request,
    running,
    start_surfaces,
    upload,
)

CHECKS = (
    "auth",
    "host",
    "origin",
    "csrf",
    "read_deadline",
    "body_bound",
    "depth",
    "owner_bounds",
    "rate_limit",
    "ownership",
    "one_record",
    "header_bytes",
    "query_bytes",
)
MET, MISSED, NA = "met", "missed", "n.a."
REFUSED = (401, 403)
FOREIGN_HOST = b"rebind.attacker.example"
CROSS_SITE = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
SAFE = ("GET", "HEAD")

Result = tuple[str, str]  # (met | missed | n.a., why)


def _anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def _operator(op: dict[str, Any]) -> bool:
    return op["x-tokenway-surface"] in ("admin", "console")


def check_auth(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    auth = op["x-tokenway-auth"]
    if auth == "none":
        return NA, ""
    headers, body = example_request(s, method, path)
    url = path_values(s, path)
    tries = {"none": {}, "wrong key": bearer("sk-wrong-" + uuid.uuid4().hex)}
    if auth == "admin":
        tries["an API key"] = bearer(KEY)
    for name, creds in tries.items():
        status, _, raw = request(s.main.port, method, url, {**headers, **creds}, body)
        if status not in REFUSED or not error_shaped(raw, _anthropic(path)):
            return MISSED, f"{name}: {status}"
    return MET, ""


def check_host(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    """On the loopback gateway (no admin token): a DNS-rebinding page's request names a foreign
    Host; a same-host proxy's adds X-Forwarded-For. Neither may reach admin or console state."""
    if not _operator(op) or path.startswith("/ui/static") or path in ("/ui", "/ui/"):
        return NA, ""
    headers, body = example_request(s, method, path)
    if path == "/ui/login":
        body = orjson.dumps({"token": ""})
    url = path_values(s, path)
    port = s.loopback.port
    tries: list[tuple[str, dict[str, str], bytes]] = [
        ("foreign Host", headers, FOREIGN_HOST + f":{port}".encode()),
        ("proxied", {**headers, "X-Forwarded-For": "203.0.113.9"}, b"127.0.0.1"),
    ]
    for name, sent, host in tries:
        status, answer, _ = request(port, method, url, sent, body, host=host)
        if path == "/ui/session":
            if status != 200 and status not in (400, 403, 421):
                return MISSED, f"{name}: {status}"
            continue
        if (
            "set-cookie" in answer
            and "tokenway_console=" in answer["set-cookie"]
            and "Max-Age=0" not in answer["set-cookie"]
        ):
            return MISSED, f"{name}: a session cookie"
        if path != "/ui/logout" and status not in (400, 401, 403, 421):
            return MISSED, f"{name}: {status}"
    return MET, ""


def check_origin(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    if not _operator(op) or method in SAFE:
        return NA, ""
    headers, body = example_request(s, method, path)
    if path == "/ui/login":
        body = orjson.dumps({"token": ADMIN})
    url = path_values(s, path)
    status, answer, _ = request(s.main.port, method, url, {**headers, **bearer(ADMIN), **CROSS_SITE}, body)
    if status != 403 or "tokenway_console=" in answer.get("set-cookie", ""):
        return MISSED, f"token + cross-site: {status}"
    status, _, _ = request(s.loopback.port, method, path_values(s, path), {**headers, **CROSS_SITE}, body)
    if status != 403:
        return MISSED, f"loopback + cross-site: {status}"
    return MET, ""


_COOKIES: dict[int, str] = {}  # one console session per gateway: the login flood check backs the address off


def console_cookie(s: Surfaces) -> str:
    """The console session cookie of the main gateway, logged in once (before the login check's 40 wrong
    tokens put 127.0.0.1 into the login backoff, which would answer a later right token 429)."""
    if s.main.port in _COOKIES:
        return _COOKIES[s.main.port]
    status, answer, _ = request(
        s.main.port, "POST", "/ui/login", {"Content-Type": "application/json"}, orjson.dumps({"token": ADMIN})
    )
    cookie = answer.get("set-cookie", "").split(";", 1)[0]
    if status != 200 or not cookie:
        raise RuntimeError(f"console login: {status}")
    _COOKIES[s.main.port] = cookie
    return cookie


def check_csrf(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    if op["x-tokenway-surface"] != "admin" or method in SAFE:
        return NA, ""
    headers, body = example_request(s, method, path)
    origin = f"http://127.0.0.1:{s.main.port}"
    sent = {**headers, "Cookie": console_cookie(s), "Origin": origin, "Sec-Fetch-Site": "same-origin"}
    status, _, _ = request(s.main.port, method, path_values(s, path), sent, body)
    return (MET, "") if status in REFUSED else (MISSED, f"cookie without token: {status}")


def _slow_body(s: Surfaces, method: str, path: str, headers: dict[str, str]) -> float | None:
    """Seconds until the gateway ended a connection whose announced body never came; None if it
    was still open after request_read_timeout_s + 12 s."""
    head = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Length: 100000",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    limit = READ_TIMEOUT_S + 12.0
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", s.main.port), timeout=limit) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + b'{"model": "')
        sock.settimeout(0.5)
        while time.monotonic() - started < limit:
            try:
                if not sock.recv(65536):
                    return time.monotonic() - started
            except TimeoutError:
                continue
            except OSError:
                return time.monotonic() - started
    return None


def check_read_deadline(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    if method in SAFE or method == "DELETE":
        return NA, ""
    headers, _ = example_request(s, method, path)
    took = _slow_body(s, method, path_values(s, path), {**headers, **credentials(op["x-tokenway-auth"])})
    return (MISSED, "still open") if took is None else (MET, f"{took:.1f} s")


def _refuses_valid(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> int | None:
    """The status a valid request gets when the route refuses it here for a reason of its own (a
    floor on a pool that is not autoscaled: 409), before it reads any body; None when it serves it."""
    headers, body = example_request(s, method, path)
    status, _, _ = request(
        s.main.port, method, path_values(s, path), {**headers, **credentials(op["x-tokenway-auth"])}, body
    )
    return status if status in (404, 409) else None


def check_body_bound(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    if "requestBody" not in op:
        return NA, ""
    creds = credentials(op["x-tokenway-auth"])
    if (method, path) == ("POST", "/v1/files"):
        content_type, body = multipart({"purpose": "batch"}, batch_line() * (MAX_FILE // len(batch_line()) + 200))
        headers = {"Content-Type": content_type}
    else:
        headers, _ = example_request(s, method, path)
        example = EXAMPLES.get((method, path), {})
        body = orjson.dumps({**example, "pad": "x" * (MAX_BODY + 65536)})
        headers = {"Content-Type": "application/json"}
    status, _, raw = request(s.main.port, method, path_values(s, path), {**headers, **creds}, body)
    if status == 413 and error_shaped(raw, _anthropic(path)):
        return MET, ""
    if status == _refuses_valid(s, method, path, op):
        return NA, f"a valid request is refused here too ({status}) before its body is read"
    return MISSED, f"{status}{'' if error_shaped(raw, _anthropic(path)) else ', not the API error shape'}"


def check_depth(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    content = op.get("requestBody", {}).get("content", {})
    if "application/json" not in content:
        return NA, ""
    example = EXAMPLES.get((method, path))
    if example is None:
        _, raw_example = example_request(s, method, path)
        example = orjson.loads(raw_example) if raw_example else {}
    creds = credentials(op["x-tokenway-auth"])
    status, _, raw = request(
        s.main.port, method, path_values(s, path), {"Content-Type": "application/json", **creds}, deep_json(example)
    )
    if status == 400 and error_shaped(raw, _anthropic(path)):
        return MET, ""
    if status == _refuses_valid(s, method, path, op):
        return NA, f"a valid request is refused here too ({status}) before its body is read"
    return MISSED, str(status)


def check_owner_bounds(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    if (method, path) == ("POST", "/v1/responses"):
        body = orjson.dumps(EXAMPLES[(method, path)])
        sent = {"Content-Type": "application/json"}
        status, _, raw = request(s.main.port, method, path, {**sent, **bearer(OTHER)}, body)
        if status != 200:
            return MISSED, f"the other key's response: {status}"
        theirs = orjson.loads(raw)["id"]
        for _ in range(PER_KEY_RESPONSES * 2):
            request(s.main.port, method, path, {**sent, **bearer(KEY)}, body)
        status, _, _ = request(s.main.port, "GET", f"/v1/responses/{theirs}", bearer(OTHER))
        return (MET, "") if status == 200 else (MISSED, f"the other key's response after the flood: {status}")
    if (method, path) == ("POST", "/v1/files"):
        status, theirs = upload(s, OTHER)
        if status != 200:
            return MISSED, f"the other tenant's file: {status}"
        tenant = "flood" + uuid.uuid4().hex[:8]
        admin_json(s, "POST", "/admin/tenants", {"name": tenant})
        _, flooder = new_api_key(s, tenant)
        flood = sorted({upload(s, flooder)[0] for _ in range(TENANT_FILES + 2)})
        status, _ = upload(s, OTHER)
        kept, _, _ = request(s.main.port, "GET", f"/v1/files/{theirs['id']}", bearer(OTHER))
        if kept != 200 or status != 200:
            return MISSED, f"the other tenant after a flood ({flood}): kept {kept}, upload {status}"
        return MET, ""
    return NA, ""


def check_rate_limit(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    if path == "/ui/login":
        statuses = [
            request(s.main.port, "POST", path, {"Content-Type": "application/json"}, b'{"token": "wrong"}')[0]
            for _ in range(40)
        ]
        return (MET, "") if 429 in statuses else (MISSED, f"40 wrong tokens: {sorted(set(statuses))}")
    if op["x-tokenway-auth"] != "key" or method != "POST" or "requestBody" not in op:
        return NA, ""
    _, secret = new_api_key(s, "rated", rpm=3)
    statuses = []
    made = example_request(s, method, path, secret)  # a batch's file, uploaded by the key itself
    for _ in range(6):
        headers, body = made if (method, path) == ("POST", "/v1/batches") else example_request(s, method, path)
        statuses.append(request(s.main.port, method, path_values(s, path), {**headers, **bearer(secret)}, body)[0])
    return (MET, "") if 429 in statuses else (MISSED, f"rpm 3, 6 sent: {statuses}")


def check_ownership(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    if (method, path) == ("POST", "/v1/responses"):
        rid = "chaos-" + uuid.uuid4().hex
        made = []
        for _ in range(2):
            status, _, raw = request(
                s.main.port,
                method,
                path,
                {"Content-Type": "application/json", "x-request-id": rid, **bearer(KEY)},
                orjson.dumps(EXAMPLES[(method, path)]),
            )
            made.append(orjson.loads(raw).get("id") if status == 200 else None)
        if None in made or made[0] == made[1]:
            return MISSED, f"same x-request-id: {made}"
        return MET, ""
    if not op.get("x-tokenway-owned"):
        return NA, ""
    owned = create_objects(s)  # fresh ones: a missed check may delete or cancel them
    status, _, _ = request(s.main.port, method, path_values(s, path, owned), bearer(OTHER))
    if status != 404:
        return MISSED, f"another key: {status}"
    if path == "/v1/files/{file_id}/content":
        fid = owned["file_id"]
        status, _, _ = request(s.main.port, method, f"/v1/files/{fid}/../{fid}/content", bearer(KEY))
        if status == 200:
            return MISSED, "a non-canonical path answered 200"
    return MET, ""


def check_one_record(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    if not op.get("x-tokenway-ledger"):
        return NA, ""
    example = EXAMPLES[(method, path)]
    sent: dict[str, int] = {}
    for body in (example, {"model": MODEL}):
        rid = "chaos-" + uuid.uuid4().hex
        status, _, _ = request(
            s.main.port,
            method,
            path,
            {"Content-Type": "application/json", "x-request-id": rid, **bearer(KEY)},
            orjson.dumps(body),
        )
        sent[rid] = status

    def counts() -> dict[str, int]:
        found = dict.fromkeys(sent, 0)
        for record in s.stack.records():
            if record.get("request_id") in found:
                found[record["request_id"]] += 1
        return found

    until(lambda: all(n >= 1 for n in counts().values()), timeout_s=10)
    time.sleep(0.3)
    found = counts()
    if any(n != 1 for n in found.values()):
        return MISSED, ", ".join(f"{sent[r]}: {n} records" for r, n in found.items())
    return MET, ""


HOSTILE_HEADERS = [  # every header the gateway reads beside credentials, holding bytes that are not UTF-8
    (b"x-request-id", b"f\xad\xab"),
    (b"x-session-id", b"\xea"),
    (b"x-claude-code-session-id", b"s\xff"),
    (b"x-session-affinity", b"\xc3\x28"),
    (b"x-tokenway-program", b"p\xff\xfe"),
    (b"x-tokenway-user", b"u\xea"),
    (b"x-tokenway-tags", b"team:\xea,env:\xff"),
    (b"x-tokenway-run-budget-usd", b"1\xea"),
    (b"x-tokenway-run-seconds", b"\xff"),
    (b"x-tokenway-no-fallback", b"\xea"),
    (b"x-tokenway-debug", b"1"),
    (b"x-tokenway-admin-token", b"\xea\xff"),
    (b"x-slo-ttft-ms", b"\xea"),
    (b"X-Tokenway-CSRF", b"\xea"),
    (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    (b"tracestate", b"vendor=\xea\xff"),
    (b"anthropic-version", b"\xea"),
    (b"User-Agent", b"agent/\xc3\x28"),
]


def check_header_bytes(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    headers, body = example_request(s, method, path)
    url = path_values(s, path)  # a fresh key, tenant or override where the route removes one
    if method == "DELETE" and not any(p in path for p in ("{key_id}", "{override_id}", "{name}")):
        url = url.rsplit("/", 1)[0] + "/none-" + uuid.uuid4().hex[:8]  # keep the probe's shared objects
    sent = {**headers, **credentials(op["x-tokenway-auth"])}
    pairs = [(k.encode("latin-1"), v.encode()) for k, v in sent.items()] + HOSTILE_HEADERS
    status, _, raw = request(s.main.port, method, url, pairs, body)
    if status == 0 or status >= 500:
        return MISSED, f"{status} {raw[:80]!r}"
    return MET, ""


HOSTILE_QUERY_VALUES = (
    b"%ff%fe",
    b"\xea\xff",
    b"%00",
    b"9" * 400,
    b"x" * 10_000,
    b"-1",
    b"nan",
    b"1e309",
    b"2026-13-45T99:99:99Z",
    b"",
)


def check_query_bytes(s: Surfaces, method: str, path: str, op: dict[str, Any]) -> Result:
    names = [p["name"] for p in op.get("parameters", []) if p.get("in") == "query"]
    if not names:
        return NA, ""
    headers, body = example_request(s, method, path)
    creds = [(k.encode("latin-1"), v.encode()) for k, v in {**headers, **credentials(op["x-tokenway-auth"])}.items()]
    base = path_values(s, path).encode()
    for name in names:
        for value in HOSTILE_QUERY_VALUES:
            status, _, raw = request(s.main.port, method, base + b"?" + name.encode() + b"=" + value, creds, body)
            if status == 0 or status >= 500:
                return MISSED, f"{name}={value[:20]!r}: {status} {raw[:80]!r}"
    return MET, ""


CHECKERS: dict[str, Callable[[Surfaces, str, str, dict[str, Any]], Result]] = {
    "auth": check_auth,
    "host": check_host,
    "origin": check_origin,
    "csrf": check_csrf,
    "read_deadline": check_read_deadline,
    "body_bound": check_body_bound,
    "depth": check_depth,
    "owner_bounds": check_owner_bounds,
    "rate_limit": check_rate_limit,
    "ownership": check_ownership,
    "one_record": check_one_record,
    "header_bytes": check_header_bytes,
    "query_bytes": check_query_bytes,
}


def run_check(s: Surfaces, check: str, method: str, path: str, op: dict[str, Any]) -> Result:
    try:
        return CHECKERS[check](s, method, path, op)
    except Exception as exc:  # a check that cannot run is a miss, reported with why
        return MISSED, f"could not run: {type(exc).__name__}: {str(exc)[:120]}"


def run_checklist(s: Surfaces, ops: list[Op] | None = None, checks: tuple[str, ...] = CHECKS) -> dict[str, Any]:
    """Every check on every operation (the slow-body checks side by side)."""
    ops = ops if ops is not None else s.operations()
    if not s.ids:
        s.ids = create_objects(s)
    if "csrf" in checks:
        console_cookie(s)  # before any login check floods the address
    table: dict[tuple[str, str], dict[str, Result]] = {(m, p): {} for m, p, _ in ops}
    slow = [(m, p, op) for m, p, op in ops if "read_deadline" in checks]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(slow))) as pool:
        futures = {(m, p): pool.submit(run_check, s, "read_deadline", m, p, op) for m, p, op in slow}
        for method, path, op in ops:
            for check in checks:
                if check != "read_deadline":
                    table[(method, path)][check] = run_check(s, check, method, path, op)
        for where, future in futures.items():
            table[where]["read_deadline"] = future.result()
    for row in table.values():
        row.update({c: (NA, "") for c in CHECKS if c not in row})
    return {"checks": list(checks), "table": table, "gateway_5xx_in_log": s.main.log().count(" 500 ")}


def run(workdir: Path) -> dict[str, Any]:
    with running(start_surfaces(workdir)) as s:
        return run_checklist(s)


def section(result: dict[str, Any]) -> list[str]:
    table: dict[tuple[str, str], dict[str, Result]] = result["table"]
    checks: list[str] = result["checks"]
    lines = [
        "## Per-surface checklist (every route of /openapi.json)",
        "",
        "Each route of the gateway's OpenAPI document against each promise that concerns it "
        "(bench/chaos/checklist.py says what is sent; docs/security.md lists the surfaces). "
        f"`request_read_timeout_s` {READ_TIMEOUT_S:g}, body bound {MAX_BODY // 1024} KiB, "
        f"{PER_KEY_RESPONSES} stored responses per key, {TENANT_FILES} files per tenant.",
        "",
        "| route | " + " | ".join(checks) + " |",
        "| --- | " + " | ".join("---" for _ in checks) + " |",
    ]
    missed: list[str] = []
    counts = {MET: 0, MISSED: 0, NA: 0}
    for (method, path), row in table.items():
        cells = []
        for check in checks:
            verdict, why = row[check]
            counts[verdict] += 1
            cells.append("**missed**" if verdict == MISSED else verdict)
            if verdict == MISSED:
                missed.append(f"- `{method} {path}` {check}: {why}")
        lines.append(f"| `{method} {path}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"{counts[MET]} met, {counts[MISSED]} missed, {counts[NA]} not applicable. Target every applicable "
        f"check met: {'met' if not missed else '**missed**'}.",
        "",
    ]
    if missed:
        lines += ["Missed:", "", *missed, ""]
    return lines

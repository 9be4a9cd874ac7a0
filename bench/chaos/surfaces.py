"""Shared by the schema-driven fuzz and the per-surface checklist: the gateway's OpenAPI document
(fetched from the running gateway's `GET /openapi.json`), a stack that serves every route of it, a
valid request for every operation, and a raw HTTP client that sends any byte and reads any answer.

The stack: a Redis the probe owns (limits, budgets, keys, stored responses), two simulated engines,
and two gateways over them:

- `main`: `server.admin_token`, a metrics token, `state: redis`, a ledger, a short
  `request_read_timeout_s`, a 1 MiB body bound and small per-owner store bounds. Three file keys in
  three tenants (KEY, OTHER, RATED) and keys made through the admin API.
- `loopback`: `make run`'s trust model (no admin token, loopback only), for what a DNS-rebinding page
  or a same-host proxy could reach there.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import secrets
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.chaos.common import ADMIN, KEY, MODEL, PREFIX, OwnRedis, Stack, start_stack
from policies.policy import hash_key
from tests.support.procs import Gateway, start_gateway, static_pool

OTHER = "sk-chaos-bench-0002"
RATED = "sk-chaos-bench-0003"
METRICS = "chaos-metrics-token"
READ_TIMEOUT_S = 3.0
MAX_BODY = 1024 * 1024
MAX_FILE = 1024 * 1024
PER_KEY_RESPONSES = 5
TENANT_FILES = 50
Op = tuple[str, str, dict[str, Any]]  # (METHOD, path template, operation)


def surface_policies() -> dict[str, Any]:
    return {
        "tenants": {"bench": {}, "other": {}, "rated": {}},
        "keys": [
            {"id": "bench", "tenant": "bench", "sha256": hash_key(KEY)},
            {"id": "other", "tenant": "other", "sha256": hash_key(OTHER)},
            {"id": "rated", "tenant": "rated", "sha256": hash_key(RATED)},
        ],
        "models": {
            MODEL: {
                "context_length": 4096,
                "default_max_tokens": 32,
                "price": {"input_per_mtok": 1.0, "cached_input_per_mtok": 0.1, "output_per_mtok": 4.0},
            }
        },
        "limits": [
            {"scope": "key", "tpm": 50_000_000, "max_concurrent": 512},
            {"scope": "key", "match": {"tenant": "rated"}, "rpm": 3},
        ],
        "budgets": [{"scope": "tenant", "usd_per_day": 10_000.0}],
    }


@dataclass
class Surfaces:
    """The running stack, its document, and ids of objects each key owns."""

    workdir: Path
    redis: OwnRedis
    stack: Stack
    loopback: Gateway
    doc: dict[str, Any] = field(default_factory=dict)
    ids: dict[str, str] = field(default_factory=dict)  # file_id, batch_id, response_id of KEY

    @property
    def main(self) -> Gateway:
        return self.stack.gateway

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.loopback.stop()
        self.stack.stop()
        self.redis.stop()

    def operations(self) -> list[Op]:
        methods = ("get", "put", "post", "delete", "patch")
        return [(m.upper(), p, item[m]) for p, item in self.doc["paths"].items() for m in methods if m in item]


def start_surfaces(workdir: Path) -> Surfaces:
    workdir.mkdir(parents=True, exist_ok=True)
    redis = OwnRedis(workdir)
    try:
        stack = start_stack(
            workdir / "main",
            engines=2,
            time_scale=50.0,
            policy=surface_policies(),
            server={"request_read_timeout_s": READ_TIMEOUT_S, "max_body_bytes": MAX_BODY},
            state={"backend": "redis", "redis_url": redis.url, "key_prefix": PREFIX},
            telemetry={"metrics": {"token": METRICS}},
            ledger={"commit_interval_ms": 20},
            apis={"response_store": {"max_responses_per_key": PER_KEY_RESPONSES}},
            batch={"dir": str(workdir / "batch"), "max_file_bytes": MAX_FILE, "tenant": {"max_files": TENANT_FILES}},
        )
    except Exception:
        redis.stop()
        raise
    try:
        loopback = start_gateway(
            workdir / "loopback",
            pools=[static_pool("llama", MODEL, [e.urls[0] for e in stack.engines])],
            policies=surface_policies(),
            server={"request_read_timeout_s": READ_TIMEOUT_S, "max_body_bytes": MAX_BODY},
            batch={"dir": str(workdir / "loopback-batch")},
            state={"keys_db": str(workdir / "loopback-keys.sqlite3")},
        )
    except Exception:
        stack.stop()
        redis.stop()
        raise
    found = Surfaces(workdir, redis, stack, loopback)
    status, _, body = request(found.main.port, "GET", "/openapi.json")
    if status != 200:
        found.stop()
        raise RuntimeError(f"GET /openapi.json answered {status}")
    found.doc = orjson.loads(body)
    return found


@contextlib.contextmanager
def running(surfaces: Surfaces) -> Iterator[Surfaces]:
    try:
        yield surfaces
    finally:
        surfaces.stop()


# ------------------------------------------------------------------------------------------- HTTP
Headers = list[tuple[bytes, bytes]]


def request(
    port: int,
    method: str,
    path: str | bytes,
    headers: Headers | dict[str, str] | None = None,
    body: bytes = b"",
    *,
    host: bytes = b"127.0.0.1",
    timeout_s: float = 60.0,
) -> tuple[int, dict[str, str], bytes]:
    """Any bytes as an HTTP/1.1 request over a new connection; (status, headers, body), status 0
    when nothing answered. Interim 100 answers are skipped."""
    pairs: Headers = (
        [(k.encode("latin-1"), v.encode("utf-8", "surrogateescape")) for k, v in headers.items()]
        if isinstance(headers, dict)
        else list(headers or [])
    )
    names = {name.lower() for name, _ in pairs}
    target = path if isinstance(path, bytes) else path.encode()  # bytes: sent as they are (no encoding)
    head = [method.encode() + b" " + target + b" HTTP/1.1"]
    if b"host" not in names:
        head.append(b"Host: " + host)
    head.append(b"Connection: close")
    head += [name + b": " + value for name, value in pairs]
    if b"content-length" not in names and (body or method in ("POST", "PUT", "PATCH")):
        head.append(b"Content-Length: " + str(len(body)).encode())
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
            response = http.client.HTTPResponse(sock, method=method)
            response.begin()
            data = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    except (OSError, http.client.HTTPException):
        return 0, {}, b""


def error_shaped(body: bytes, anthropic: bool = False) -> bool:
    """Whether `body` is the API's error shape (OpenAI's, or Anthropic's under /v1/messages)."""
    try:
        found = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(found, dict) or not isinstance(found.get("error"), dict):
        return False
    if anthropic:
        return found.get("type") == "error" and "message" in found["error"]
    return "message" in found["error"]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def multipart(fields: dict[str, str], file: bytes, filename: str = "in.jsonl") -> tuple[str, bytes]:
    """(Content-Type, body) of a multipart/form-data upload with `fields` and a `file` part."""
    boundary = "tokenway" + secrets.token_hex(8)
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n".encode()
        + file
        + b"\r\n"
    )
    return f"multipart/form-data; boundary={boundary}", b"".join(parts) + f"--{boundary}--\r\n".encode()


def batch_line(n: int = 0) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"line {n}"}], "max_tokens": 2}
    return orjson.dumps({"custom_id": f"c{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + b"\n"


# ----------------------------------------------------------------------------- valid requests
MESSAGES = [{"role": "user", "content": "hi"}]
EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/chat/completions"): {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
    ("POST", "/v1/completions"): {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    ("POST", "/v1/embeddings"): {"model": MODEL, "input": "hi"},
    ("POST", "/v1/responses"): {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    ("POST", "/v1/messages"): {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
    ("POST", "/v1/messages/count_tokens"): {"model": MODEL, "messages": MESSAGES},
    ("POST", "/v1/programs/{program}/outcome"): {"success": True, "value": 1},
    ("POST", "/admin/keys"): {"tenant": "bench"},
    ("PATCH", "/admin/keys/{key_id}"): {"metadata": {"owner": "chaos"}},
    ("POST", "/admin/keys/{key_id}/rotate"): {"grace_s": 0},
    ("PATCH", "/admin/tenants/{name}"): {"allow_fallback": True},
    ("PUT", "/admin/pools/{pool}/floor"): {"min_replicas": 0, "for_s": 60},
    ("POST", "/admin/overrides"): {"rule": "tenant", "dimension": "usd_per_day", "value": 20_000.0, "for": "1h"},
    ("POST", "/ui/login"): {"token": "not-the-token"},
}


def credentials(auth: str, *, key: str = KEY) -> dict[str, str]:
    """Headers that satisfy an operation's `x-tokenway-auth` on the main gateway."""
    return {"key": bearer(key), "admin": bearer(ADMIN), "metrics": bearer(METRICS)}.get(auth, {})


def admin_json(s: Surfaces, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    status, _, raw = request(
        s.main.port, method, path, {**bearer(ADMIN), "Content-Type": "application/json"}, orjson.dumps(body or {})
    )
    if status >= 300:
        raise RuntimeError(f"{method} {path}: {status} {raw[:300]!r}")
    found: dict[str, Any] = orjson.loads(raw)
    return found


def new_api_key(s: Surfaces, tenant: str = "bench", **limits: Any) -> tuple[str, str]:
    """(id, secret) of a key made through the admin API."""
    body: dict[str, Any] = {"tenant": tenant}
    if limits:
        body["limits"] = limits
    made = admin_json(s, "POST", "/admin/keys", body)
    return str(made["key"]["id"]), str(made["secret"])


def upload(s: Surfaces, key: str = KEY, data: bytes | None = None) -> tuple[int, dict[str, Any]]:
    content_type, body = multipart({"purpose": "batch"}, data if data is not None else batch_line())
    status, _, raw = request(s.main.port, "POST", "/v1/files", {**bearer(key), "Content-Type": content_type}, body)
    with contextlib.suppress(orjson.JSONDecodeError):
        return status, orjson.loads(raw)
    return status, {}


def create_objects(s: Surfaces, key: str = KEY) -> dict[str, str]:
    """A file, a batch over it and a stored response, all `key`'s: the ids of owned routes."""
    status, file = upload(s, key)
    if status != 200:
        raise RuntimeError(f"upload: {status} {file}")
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    status, _, raw = request(
        s.main.port, "POST", "/v1/batches", {**bearer(key), "Content-Type": "application/json"}, orjson.dumps(body)
    )
    if status != 200:
        raise RuntimeError(f"batch: {status} {raw[:300]!r}")
    batch = orjson.loads(raw)
    status, _, raw = request(
        s.main.port,
        "POST",
        "/v1/responses",
        {**bearer(key), "Content-Type": "application/json"},
        orjson.dumps(EXAMPLES[("POST", "/v1/responses")]),
    )
    if status != 200:
        raise RuntimeError(f"response: {status} {raw[:300]!r}")
    return {"file_id": file["id"], "batch_id": batch["id"], "response_id": orjson.loads(raw)["id"]}


def path_values(s: Surfaces, path: str, owned: dict[str, str] | None = None) -> str:
    """`path` with its parameters filled with real values: the probe's own objects, a fresh key or
    tenant made through the admin API for the admin routes that change or remove one."""
    values = {"pool": "llama", "model": MODEL, "name": "console.js", **(owned or s.ids)}
    if "{key_id}" in path:
        values["key_id"] = new_api_key(s)[0]
    if "{program}" in path:  # one outcome per program: a fresh one each time
        values["program"] = "chaos-" + uuid.uuid4().hex[:12]
    if "{override_id}" in path:  # a fresh override to delete
        values["override_id"] = admin_json(s, "POST", "/admin/overrides", EXAMPLES[("POST", "/admin/overrides")])["id"]
    if "{name}" in path and path.startswith("/admin/tenants"):
        name = "t" + uuid.uuid4().hex[:10]
        admin_json(s, "POST", "/admin/tenants", {"name": name})
        values["name"] = name
    return path.format(**values)


def example_request(s: Surfaces, method: str, path: str, key: str = KEY) -> tuple[dict[str, str], bytes]:
    """(headers, body) of a valid request to the operation, without credentials (a batch's input
    file is uploaded by `key`)."""
    if (method, path) == ("POST", "/v1/files"):
        content_type, body = multipart({"purpose": "batch"}, batch_line())
        return {"Content-Type": content_type}, body
    if (method, path) == ("POST", "/v1/batches"):
        status, file = upload(s, key)
        file_id = file.get("id", s.ids.get("file_id", "file-x")) if status == 200 else s.ids.get("file_id", "file-x")
        batch = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        return {"Content-Type": "application/json"}, orjson.dumps(batch)
    if (method, path) == ("POST", "/admin/tenants"):
        return {"Content-Type": "application/json"}, orjson.dumps({"name": "t" + uuid.uuid4().hex[:10]})
    example = EXAMPLES.get((method, path))
    if example is None:
        return {}, b""
    return {"Content-Type": "application/json"}, orjson.dumps(example)


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


def deep_json(example: dict[str, Any], depth: int = 300) -> bytes:
    """`example` with a field nested `depth` levels (orjson refuses to write past 254)."""
    return json.dumps({**example, "deep": nested(depth)}).encode()

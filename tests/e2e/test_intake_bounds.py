"""Bounds at intake, on every route that reads a body (a real gateway over a simulated engine, raw
HTTP): nesting depth, the read deadline, the size limit, the content encoding and the in-flight
memory budget each get a 4xx (or a 503 with Retry-After) in the route's own error shape — OpenAI's
on /v1/* and the admin API, Anthropic's on /v1/messages* — never a 5xx or aiohttp's plain text.
count_tokens obeys the key's model allow-list and request limits; unknown Anthropic `tool_choice`
types are refused; a recursive tool schema does not break the simulated engine."""

from __future__ import annotations

import gzip
import socket
import time
import zlib
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from policies.policy import hash_key
from tests.support.procs import (
    OTHER_KEY,
    TEST_KEY,
    Gateway,
    SimEngines,
    policies_doc,
    running,
    start_gateway,
    start_sim,
    static_pool,
)

pytestmark = pytest.mark.e2e

ADMIN_TOKEN = "admin-secret-for-bounds-1"
LIMITED_KEY = "tw-limited-key-0001"
MODEL, OTHER_MODEL = "llama-3.1-8b", "qwen-small"
MAX_BODY = 256 * 1024
READ_TIMEOUT_S = 2.0
DEEP = 300  # levels: deeper than orjson's encoder goes (254)


def _policies() -> dict[str, Any]:
    return policies_doc(
        tenants={"t1": {}, "t2": {"models": [MODEL]}},
        keys=[
            {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
            {"id": "k2", "tenant": "t2", "sha256": hash_key(OTHER_KEY)},
            {"id": "k3", "tenant": "t1", "sha256": hash_key(LIMITED_KEY)},
        ],
        models={MODEL: {}, OTHER_MODEL: {}},
        limits=[{"scope": "key", "match": {"key": "k3"}, "rpm": 2}],
    )


def _pools(engines: SimEngines) -> list[dict[str, Any]]:
    return [static_pool("llama", MODEL, engines.urls), static_pool("qwen", OTHER_MODEL, engines.urls)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("bounds")
    engines = start_sim(workdir, count=1, served_model_name=MODEL)
    with running(engines):
        gateway = start_gateway(
            workdir / "gw",
            pools=_pools(engines),
            policies=_policies(),
            server={
                "admin_token": ADMIN_TOKEN,
                "request_read_timeout_s": READ_TIMEOUT_S,
                "max_body_bytes": MAX_BODY,
            },
            batch={"max_file_bytes": 64 * 1024},
        )
        with running(gateway):
            yield gateway


# --- raw HTTP --------------------------------------------------------------------------------------
def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _read_response(
    sock: socket.socket, timeout_s: float = 30.0, *, check_closed: bool = False
) -> tuple[int, dict[str, str], bytes, bool]:
    """(status, headers, body, closed): the first response on `sock`, and (`check_closed`) whether
    the server then closed the connection."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and lines[0].startswith("HTTP/") else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    closed = False
    if check_closed:
        try:
            closed = sock.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            closed = False
    return status, headers, rest[:length], closed


def call(
    gateway: Gateway, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, dict[str, str], Any]:
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        try:
            sock.sendall(
                _head(method, path, {"Content-Length": str(len(body)), "Connection": "close", **headers}) + body
            )
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered (and closed) before the whole body was sent
        status, answered, raw, _ = _read_response(sock)
    try:
        parsed: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = raw
    return status, answered, parsed


# --- routes and their error shapes -----------------------------------------------------------------
def _auth(path: str) -> dict[str, str]:
    if path.startswith("/admin"):
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    if path.startswith("/ui"):
        return {}
    return {"Authorization": f"Bearer {TEST_KEY}"}


def _valid(path: str) -> dict[str, Any]:
    """A body the route accepts (its fields are what a deep extra field is added to)."""
    messages = [{"role": "user", "content": "hi"}]
    bodies: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {"model": MODEL, "messages": messages, "max_tokens": 2},
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        "/v1/embeddings": {"model": MODEL, "input": "hi"},
        "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
        "/v1/messages": {"model": MODEL, "messages": messages, "max_tokens": 2},
        "/v1/messages/count_tokens": {"model": MODEL, "messages": messages},
        "/v1/batches": {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        "/admin/keys": {"tenant": "t1"},
        "/ui/login": {"token": ADMIN_TOKEN},
    }
    return dict(bodies[path])


JSON_ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/batches",
    "/admin/keys",
    "/ui/login",
]


def assert_error_shape(path: str, parsed: Any, status: int) -> dict[str, Any]:
    """The route's own error shape; returns its error object."""
    assert isinstance(parsed, dict), parsed
    if path.startswith("/v1/messages"):
        assert parsed.get("type") == "error" and set(parsed["error"]) >= {"type", "message"}, parsed
        return dict(parsed["error"])
    assert set(parsed) == {"error"} and {"message", "type", "code"} <= set(parsed["error"]), parsed
    return dict(parsed["error"])


def _deep_body(path: str) -> bytes:
    base = orjson.dumps(_valid(path))
    return base[:-1] + b',"deep":' + b"[" * DEEP + b"]" * DEEP + b"}"


# --- class 6: nesting ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", JSON_ROUTES)
def test_a_body_nested_too_deep_is_a_400_naming_the_field(fleet: Gateway, path: str) -> None:
    headers = {**_auth(path), "Content-Type": "application/json"}
    status, _, parsed = call(fleet, "POST", path, headers, _deep_body(path))
    assert status == 400, parsed
    error = assert_error_shape(path, parsed, status)
    assert "'deep[0][0]" in error["message"], error
    if not path.startswith("/v1/messages"):
        assert str(error["param"]).startswith("deep[0][0]"), error


def test_a_deep_body_still_parses_when_under_the_bound(fleet: Gateway) -> None:
    body = _valid("/v1/chat/completions")
    body["metadata"] = {"k": "v"}
    body["extra_nested"] = orjson.loads(b"[" * 40 + b"]" * 40)
    status, _, parsed = call(
        fleet, "POST", "/v1/chat/completions", {**_auth("/v1"), "Content-Type": "application/json"}, orjson.dumps(body)
    )
    assert status == 200, parsed


# --- class 13: cheap checks before the body ------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"])
def test_a_wrong_key_is_refused_before_the_body_is_read(fleet: Gateway, path: str) -> None:
    headers = {"Authorization": "Bearer wrong-key", "Content-Type": "application/json", "Content-Length": "200000"}
    with socket.create_connection(("127.0.0.1", fleet.port)) as sock:
        sock.sendall(_head("POST", path, headers) + b'{"model": "')  # the rest never comes
        status, _, raw, _ = _read_response(sock, timeout_s=READ_TIMEOUT_S + 20)
    assert status == 401, raw
    assert_error_shape(path, orjson.loads(raw), status)


# --- class 8: the read deadline --------------------------------------------------------------------
SLOW_ROUTES = [
    ("/v1/chat/completions", "application/json"),
    ("/v1/messages/count_tokens", "application/json"),
    ("/v1/batches", "application/json"),
    ("/v1/files", "multipart/form-data; boundary=XyZ"),
    ("/admin/keys", "application/json"),
    ("/ui/login", "application/json"),
]


@pytest.mark.parametrize(("path", "content_type"), SLOW_ROUTES)
def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_closes(
    fleet: Gateway, path: str, content_type: str
) -> None:
    start = b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nba' if path == "/v1/files" else b'{"mo'
    headers = {**_auth(path), "Content-Type": content_type, "Content-Length": "5000"}
    with socket.create_connection(("127.0.0.1", fleet.port)) as sock:
        sock.sendall(_head("POST", path, headers) + start)  # and nothing more
        status, _, raw, closed = _read_response(sock, timeout_s=READ_TIMEOUT_S + 20, check_closed=True)
    assert status == 408, raw
    error = assert_error_shape(path, orjson.loads(raw), status)
    assert "did not arrive" in error["message"]
    assert closed


# --- class 16: a 413 in the API's shape ------------------------------------------------------------
@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/admin/keys", "/ui/login"]
)
def test_a_body_over_the_limit_is_a_413_in_the_routes_shape(fleet: Gateway, path: str) -> None:
    headers = {**_auth(path), "Content-Type": "application/json", "Content-Length": str(MAX_BODY + 1)}
    with socket.create_connection(("127.0.0.1", fleet.port)) as sock:
        sock.sendall(_head("POST", path, headers) + b'{"model": "x"')
        status, _, raw, _ = _read_response(sock)
    assert status == 413, raw
    assert_error_shape(path, orjson.loads(raw), status)


def test_a_chunked_body_over_the_limit_is_a_413(fleet: Gateway) -> None:
    chunk = b"x" * 65536
    framed = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(MAX_BODY // len(chunk) + 1)) + b"0\r\n\r\n"
    headers = {**_auth("/v1"), "Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    with socket.create_connection(("127.0.0.1", fleet.port)) as sock:
        sock.sendall(_head("POST", "/v1/chat/completions", headers))
        try:
            sock.sendall(framed)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed before the last bytes
        status, _, raw, _ = _read_response(sock)
    assert status == 413, raw
    assert_error_shape("/v1/chat/completions", orjson.loads(raw), status)


# --- class 16: content encodings -------------------------------------------------------------------
def _encodings() -> list[Any]:
    good = orjson.dumps(_valid("/v1/chat/completions"))
    packed = gzip.compress(good)
    bomb = gzip.compress(b" " * (MAX_BODY * 4) + good)
    return [
        pytest.param("gzip", packed[:-12], 400, id="truncated-gzip"),
        pytest.param("gzip", packed + packed, 400, id="two-gzip-members"),
        pytest.param("gzip", packed + b"trailing", 400, id="gzip-then-garbage"),
        pytest.param("gzip, gzip", gzip.compress(packed), 400, id="doubled-coding"),
        pytest.param("br", packed, 400, id="unsupported-coding"),
        pytest.param("gzip", bomb, 413, id="gzip-bomb"),
        pytest.param("gzip", packed, 200, id="good-gzip"),
        pytest.param("deflate", zlib.compress(good), 200, id="good-deflate"),
        pytest.param("identity", good, 200, id="identity"),
    ]


@pytest.mark.parametrize(("coding", "body", "expected"), _encodings())
def test_a_body_is_decoded_strictly(fleet: Gateway, coding: str, body: bytes, expected: int) -> None:
    headers = {**_auth("/v1"), "Content-Type": "application/json", "Content-Encoding": coding}
    status, _, parsed = call(fleet, "POST", "/v1/chat/completions", headers, body)
    assert status == expected, parsed
    if expected != 200:
        assert_error_shape("/v1/chat/completions", parsed, status)


def test_a_truncated_gzip_on_count_tokens_is_an_anthropic_400(fleet: Gateway) -> None:
    packed = gzip.compress(orjson.dumps(_valid("/v1/messages/count_tokens")))
    headers = {**_auth("/v1"), "Content-Type": "application/json", "Content-Encoding": "gzip"}
    status, _, parsed = call(fleet, "POST", "/v1/messages/count_tokens", headers, packed[:-12])
    assert status == 400, parsed
    assert assert_error_shape("/v1/messages", parsed, status)["type"] == "invalid_request_error"


# --- class 16: count_tokens under the main route's rules -------------------------------------------
def test_count_tokens_obeys_the_model_allow_list(fleet: Gateway) -> None:
    body = orjson.dumps({**_valid("/v1/messages/count_tokens"), "model": OTHER_MODEL})
    headers = {"Authorization": f"Bearer {OTHER_KEY}", "Content-Type": "application/json"}
    status, _, parsed = call(fleet, "POST", "/v1/messages/count_tokens", headers, body)
    assert status == 403, parsed
    assert assert_error_shape("/v1/messages", parsed, status)["type"] == "permission_error"
    status, _, parsed = call(fleet, "POST", "/v1/messages", headers, body[:-1] + b',"max_tokens":2}')
    assert status == 403, parsed  # as the main route answers
    allowed = orjson.dumps(_valid("/v1/messages/count_tokens"))
    status, _, parsed = call(fleet, "POST", "/v1/messages/count_tokens", headers, allowed)
    assert status == 200 and parsed["input_tokens"] > 0, parsed
    unknown = orjson.dumps({**_valid("/v1/messages/count_tokens"), "model": "no-such-model"})
    status, _, parsed = call(fleet, "POST", "/v1/messages/count_tokens", headers, unknown)
    assert status == 404, parsed


def test_count_tokens_counts_against_the_keys_request_limit(fleet: Gateway) -> None:
    headers = {"Authorization": f"Bearer {LIMITED_KEY}", "Content-Type": "application/json"}
    body = orjson.dumps(_valid("/v1/messages/count_tokens"))
    answers = [call(fleet, "POST", "/v1/messages/count_tokens", headers, body) for _ in range(3)]
    assert [a[0] for a in answers] == [200, 200, 429], answers
    error = assert_error_shape("/v1/messages", answers[2][2], 429)
    assert error["type"] == "rate_limit_error"
    assert "retry-after" in answers[2][1]
    # the main route sees the same spent limit, and refuses before counting the prompt
    chat = orjson.dumps(_valid("/v1/chat/completions"))
    status, _, parsed = call(fleet, "POST", "/v1/chat/completions", headers, chat)
    assert status == 429, parsed
    assert parsed["error"]["code"] == "rate_limit_exceeded"


# --- class 16: Anthropic tool_choice and recursive schemas ----------------------------------------
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("choice", [{"type": "bogus"}, "auto", {"type": "tool"}])
def test_an_unknown_tool_choice_is_an_anthropic_400(fleet: Gateway, path: str, choice: Any) -> None:
    body = orjson.dumps({**_valid(path), "tool_choice": choice})
    status, _, parsed = call(fleet, "POST", path, {**_auth(path), "Content-Type": "application/json"}, body)
    assert status == 400, parsed
    error = assert_error_shape(path, parsed, status)
    assert error["type"] == "invalid_request_error" and "tool_choice" in error["message"]


RECURSIVE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}, "minItems": 2}},
    "required": ["name", "children"],
}


def test_a_recursive_tool_schema_gets_an_answer(fleet: Gateway) -> None:
    tool = {"type": "function", "function": {"name": "tree", "parameters": RECURSIVE}}
    body = {**_valid("/v1/chat/completions"), "tools": [tool], "tool_choice": "required", "max_tokens": 64}
    status, _, parsed = call(
        fleet, "POST", "/v1/chat/completions", {**_auth("/v1"), "Content-Type": "application/json"}, orjson.dumps(body)
    )
    assert status == 200, parsed
    schema_format = {"type": "json_schema", "json_schema": {"name": "tree", "schema": RECURSIVE}}
    body = {**_valid("/v1/chat/completions"), "response_format": schema_format, "max_tokens": 64}
    status, _, parsed = call(
        fleet, "POST", "/v1/chat/completions", {**_auth("/v1"), "Content-Type": "application/json"}, orjson.dumps(body)
    )
    assert status == 200, parsed


# --- class 13: the in-flight body budget -----------------------------------------------------------
@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway whose body budget holds one large body at a time."""
    workdir = tmp_path_factory.mktemp("budget")
    engines = start_sim(workdir, count=1, served_model_name=MODEL)
    with running(engines):
        gateway = start_gateway(
            workdir / "gw",
            pools=_pools(engines),
            policies=_policies(),
            server={"max_body_bytes": 200_000, "max_inflight_body_bytes": 300_000, "request_read_timeout_s": 60},
        )
        with running(gateway):
            yield gateway


def _big_body(path: str, size: int) -> bytes:
    base = _valid(path)  # chat and messages bodies both carry `messages`
    base["messages"] = [{"role": "user", "content": "word " * ((size - 200) // 5)}]
    return orjson.dumps(base)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_bodies_over_the_memory_budget_wait_their_turn(tight: Gateway, path: str) -> None:
    held = _big_body("/v1/chat/completions", 180_000)
    headers = {**_auth("/v1"), "Content-Type": "application/json", "Content-Length": str(len(held))}
    with socket.create_connection(("127.0.0.1", tight.port)) as first:
        first.sendall(_head("POST", "/v1/chat/completions", headers) + held[:1000])  # holds 180 kB of budget
        second = _big_body(path, 150_000)
        deadline = time.monotonic() + 20
        while True:  # the first body's reservation is made when its handler starts reading
            status, answered, parsed = call(
                tight, "POST", path, {**_auth(path), "Content-Type": "application/json"}, second
            )
            if status != 200 or time.monotonic() > deadline:
                break
        assert status == 503, parsed
        assert answered.get("retry-after") == "1"
        error = assert_error_shape(path, parsed, status)
        if path.startswith("/v1/messages"):
            assert error["type"] == "overloaded_error"
        else:
            assert error["code"] == "overloaded"
        small = orjson.dumps(_valid(path))  # small bodies still fit beside it
        status, _, parsed = call(tight, "POST", path, {**_auth(path), "Content-Type": "application/json"}, small)
        assert status == 200, parsed
        first.sendall(held[1000:])
        status, _, raw, _ = _read_response(first)
        assert status == 200, raw
    status, _, parsed = call(tight, "POST", path, {**_auth(path), "Content-Type": "application/json"}, second)
    assert status == 200, parsed  # the budget was given back

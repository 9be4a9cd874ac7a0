"""Hostile input end to end (a real gateway over simulated engines, raw HTTP): bytes that are not text
in credentials and request ids, a body that lies about its encoding, token ids no engine holds. Each
gets a 4xx in OpenAI's error shape, never a 5xx; each request leaves exactly one ledger record; and
nothing a client sent counts against an endpoint's health."""

from __future__ import annotations

import gzip
import http.client
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.ledger.reader import iter_entries
from tests.support.procs import (
    REPO,
    TEST_KEY,
    Gateway,
    SimEngines,
    http_get,
    policies_doc,
    running,
    start_gateway,
    start_sim,
    static_pool,
)

pytestmark = pytest.mark.e2e

ADMIN_TOKEN = "admin-secret-1"
METRICS_TOKEN = "metrics-secret-1"
CHAT = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
NOT_TEXT = "\xff\xfe\x80"  # sent as these raw bytes (http.client writes header values as latin-1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, SimEngines]]:
    workdir = tmp_path_factory.mktemp("hostile")
    engines = start_sim(workdir, count=2, served_model_name="llama-3.1-8b")
    gateway = start_gateway(
        workdir / "gw",
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(),
        server={"admin_token": ADMIN_TOKEN},
        telemetry={"metrics": {"token": METRICS_TOKEN}},
        ledger={"dir": str(workdir / "usage"), "commit_interval_ms": 20},
    )
    with running(engines, gateway):
        yield gateway, engines


def call(
    gateway: Gateway, method: str, path: str, headers: dict[str, str], body: bytes | None = None
) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            parsed = raw
        return response.status, {k.lower(): v for k, v in response.getheaders()}, parsed
    finally:
        conn.close()


def post_chat(gateway: Gateway, headers: dict[str, str], body: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    return call(
        gateway,
        "POST",
        "/v1/chat/completions",
        {"Content-Type": "application/json", **headers},
        orjson.dumps(CHAT) if body is None else body,
    )


def openai_error(body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] in ("invalid_request_error", "permission_error", "authentication_error"), error
    return dict(error)


def records(workdir: Path) -> list[dict[str, Any]]:
    return list(iter_entries(workdir / "usage"))


def record_of(gateway: Gateway, request_id: str, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [r for r in records(gateway.workdir.parent) if r["request_id"] == request_id]
        if found:
            return found
        time.sleep(0.05)
    return []


@pytest.mark.parametrize(
    ("path", "method", "header"),
    [
        pytest.param("/v1/chat/completions", "POST", "Authorization", id="chat-authorization"),
        pytest.param("/v1/chat/completions", "POST", "x-api-key", id="chat-x-api-key"),
        pytest.param("/v1/models", "GET", "Authorization", id="models-authorization"),
        pytest.param("/v1/models", "GET", "x-api-key", id="models-x-api-key"),
        pytest.param("/admin/status", "GET", "Authorization", id="admin-status"),
        pytest.param("/admin/reload", "POST", "Authorization", id="admin-reload"),
    ],
)
def test_credentials_that_are_not_text_get_401(
    fleet: tuple[Gateway, SimEngines], path: str, method: str, header: str
) -> None:
    gateway, _ = fleet
    value = f"Bearer {NOT_TEXT}" if header == "Authorization" else NOT_TEXT
    body = orjson.dumps(CHAT) if method == "POST" else None
    status, _, parsed = call(gateway, method, path, {header: value, "Content-Type": "application/json"}, body)
    assert status == 401, parsed
    assert openai_error(parsed)["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("path", "expected"),
    [("/v1/messages/count_tokens", 400), ("/v1/responses", 400), ("/admin/reload", 200)],  # reload reads no body
)
def test_every_route_answers_a_body_that_is_not_its_encoding_with_400(
    fleet: tuple[Gateway, SimEngines], path: str, expected: int
) -> None:
    gateway, _ = fleet
    token = ADMIN_TOKEN if path.startswith("/admin") else TEST_KEY
    headers = {"Authorization": f"Bearer {token}", "Content-Encoding": "deflate", "Content-Type": "application/json"}
    status, _, parsed = call(gateway, "POST", path, headers, orjson.dumps(CHAT))
    assert status == expected, parsed


def test_a_body_that_is_not_the_gzip_it_claims_gets_400(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    status, _, parsed = post_chat(gateway, {"Authorization": f"Bearer {TEST_KEY}", "Content-Encoding": "gzip"})
    assert status == 400, parsed
    openai_error(parsed)
    good = gzip.compress(orjson.dumps(CHAT))  # a real gzip body is read as usual
    status, _, parsed = post_chat(gateway, {"Authorization": f"Bearer {TEST_KEY}", "Content-Encoding": "gzip"}, good)
    assert status == 200, parsed


@pytest.mark.parametrize(
    "value", [pytest.param([-5, 3], id="negative"), pytest.param([[1, 2], [2**40]], id="above-int32")]
)
def test_embeddings_with_impossible_token_ids_get_400(fleet: tuple[Gateway, SimEngines], value: Any) -> None:
    gateway, _ = fleet
    body = orjson.dumps({"model": "llama-3.1-8b", "input": value})
    status, _, parsed = call(
        gateway,
        "POST",
        "/v1/embeddings",
        {"Authorization": f"Bearer {TEST_KEY}", "Content-Type": "application/json"},
        body,
    )
    assert status == 400, parsed
    assert openai_error(parsed)["param"] == "input"


def test_out_of_vocabulary_ids_are_the_clients_error_not_the_endpoints(fleet: tuple[Gateway, SimEngines]) -> None:
    """The engine rejects them (400, as vLLM does); the client sees OpenAI's shape and both endpoints
    stay in the pool however often it happens."""
    gateway, _ = fleet
    body = orjson.dumps({"model": "llama-3.1-8b", "input": [10**9]})
    headers = {"Authorization": f"Bearer {TEST_KEY}", "Content-Type": "application/json"}
    for _ in range(8):
        status, _, parsed = call(gateway, "POST", "/v1/embeddings", headers, body)
        assert status == 400, parsed
        openai_error(parsed)
    status, _, parsed = post_chat(gateway, {"Authorization": f"Bearer {TEST_KEY}"})
    assert status == 200, parsed
    status, text = http_get(gateway.url + "/admin/backends", {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 200
    endpoints = [e for pool in orjson.loads(text)["pools"] for e in pool["endpoints"]]
    assert len(endpoints) == 2 and all(e["state"] == "ready" for e in endpoints), endpoints


@pytest.mark.parametrize(
    "request_id",
    [
        pytest.param(NOT_TEXT + "abc", id="not-text"),
        pytest.param("x" * 5000, id="too-long"),
        pytest.param("has space", id="space"),
    ],
)
def test_a_request_id_that_is_not_short_ascii_is_replaced_and_recorded(
    fleet: tuple[Gateway, SimEngines], request_id: str
) -> None:
    gateway, _ = fleet
    status, headers, parsed = post_chat(gateway, {"Authorization": f"Bearer {TEST_KEY}", "x-request-id": request_id})
    assert status == 200, parsed
    replaced = headers["x-request-id"]
    assert replaced != request_id and len(replaced) == 32 and replaced.isascii()
    found = record_of(gateway, replaced)
    assert len(found) == 1 and found[0]["status"] == "ok"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        pytest.param("GET", "/v1/models/llama-3.1-8b", None, id="retrieve-model"),
        pytest.param("GET", "/v1/no-such-route", None, id="unknown-url"),
        pytest.param("POST", "/v1/messages/count_tokens", orjson.dumps({"model": "llama-3.1-8b"}), id="count-tokens"),
        pytest.param("GET", "/v1/responses/resp_missing", None, id="stored-response"),
    ],
)
def test_the_api_routes_outside_the_walk_replace_a_bad_request_id_too(
    fleet: tuple[Gateway, SimEngines], method: str, path: str, body: bytes | None
) -> None:
    gateway, _ = fleet
    headers = {
        "Authorization": f"Bearer {TEST_KEY}",
        "x-request-id": NOT_TEXT + "abc",
        "Content-Type": "application/json",
    }
    status, answered, parsed = call(gateway, method, path, headers, body)
    assert 200 <= status < 500, parsed
    replaced = answered["x-request-id"]
    assert len(replaced) == 32 and replaced.isascii(), replaced


def test_a_good_request_id_is_kept(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    status, headers, _ = post_chat(gateway, {"Authorization": f"Bearer {TEST_KEY}", "x-request-id": "req_Ab-9.x:1"})
    assert status == 200 and headers["x-request-id"] == "req_Ab-9.x:1"
    assert len(record_of(gateway, "req_Ab-9.x:1")) == 1


def test_metrics_need_their_token_when_one_is_set(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    assert http_get(gateway.url + "/metrics")[0] == 401
    assert http_get(gateway.url + "/metrics", {"Authorization": "Bearer wrong"})[0] == 401
    status, text = http_get(gateway.url + "/metrics", {"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert status == 200 and "tokenway_" in text


def test_cross_site_admin_posts_are_refused_even_with_the_token(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    status, _, parsed = call(gateway, "POST", "/admin/reload", {**auth, "Origin": "https://evil.example"}, b"")
    assert status == 403 and openai_error(parsed)["code"] == "cross_site_request"
    status, _, _ = call(gateway, "POST", "/admin/reload", {**auth, "Sec-Fetch-Site": "cross-site"}, b"")
    assert status == 403
    status, _, parsed = call(gateway, "POST", "/admin/reload", auth, b"")
    assert status == 200, parsed


def test_a_gateway_beyond_loopback_without_an_admin_token_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    (tmp_path / "policies.yaml").write_text("tenants: {}\n")
    config.write_text("server: {host: 0.0.0.0, port: 0}\npolicies: policies.yaml\npools: []\n")
    done = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "serve", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "server.admin_token" in done.stderr and "0.0.0.0" in done.stderr

"""A client that sends its request and shuts its write side still gets its answer; a client that closes
its socket is still noticed and its engine request aborted (raw sockets against a real gateway)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import orjson
import pytest

from tests.support.procs import TEST_KEY, Gateway, SimEngines, metric_total, static_pool

pytestmark = pytest.mark.e2e


def request_bytes(body: dict[str, object]) -> bytes:
    raw = orjson.dumps(body)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {TEST_KEY}\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    return head.encode() + raw


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def final_response(data: bytes) -> tuple[int, bytes]:
    """Skip interim 1xx responses; (status, body) of the final one."""
    while data.startswith(b"HTTP/1.1 1"):
        data = data.split(b"\r\n\r\n", 1)[1]
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.fixture
def pair(sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]) -> tuple[Gateway, SimEngines]:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b", time_scale=1)
    gateway = gateway_factory(pools=[static_pool("llama", "llama-3.1-8b", engines.urls)])
    return gateway, engines


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_half_closed_client_gets_its_answer(pair: tuple[Gateway, SimEngines], stream: bool) -> None:
    gateway, _ = pair
    body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    if stream:
        body["stream"] = True
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(request_bytes(body))
        sock.shutdown(socket.SHUT_WR)
        status, payload = final_response(read_all(sock))
    assert status == 200, payload
    if stream:
        assert b"data: [DONE]" in payload and payload.endswith(b"0\r\n\r\n")  # the last chunk, whole
    else:
        assert b'"chat.completion"' in payload


def test_a_client_that_closed_its_socket_is_still_aborted(pair: tuple[Gateway, SimEngines]) -> None:
    gateway, engines = pair
    body = {
        "model": "llama-3.1-8b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3000,
        "ignore_eos": True,
    }
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(request_bytes(body))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not metric_total(engines.urls[0], "vllm:num_requests_running"):
            time.sleep(0.05)
    # closed (not half-closed) while the engine generates: the probe finds nobody, the request aborts
    deadline = time.monotonic() + 30
    aborted = 0.0
    while time.monotonic() < deadline and not aborted:
        aborted = metric_total(engines.urls[0], "vllm:request_success_total", finished_reason="abort")
        time.sleep(0.1)
    assert aborted == 1

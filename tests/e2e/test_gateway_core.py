"""The gateway core end to end: real gateway and simulated-engine processes, the official openai client."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends import tokenization
from tests.support.procs import (
    OTHER_KEY,
    TEST_KEY,
    Gateway,
    SimEngines,
    free_ports,
    http_get,
    metric_total,
    policies_doc,
    running,
    start_gateway,
    start_sim,
    static_pool,
)

pytestmark = pytest.mark.e2e

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour."},
]
MODELS = {"llama-3.1-8b": {"aliases": ["gpt-4o-mini"]}, "qwen2.5-7b": {}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, SimEngines]]:
    """One gateway over two llama replicas and one qwen replica, shared by the tests that only read."""
    workdir = tmp_path_factory.mktemp("core-fleet")
    engines = start_sim(workdir, count=2, served_model_name="llama-3.1-8b")
    qwen = start_sim(workdir, count=1, served_model_name="qwen2.5-7b", preset="qwen2.5-7b@h100")
    gateway = start_gateway(
        workdir / "gw",
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls), static_pool("qwen", "qwen2.5-7b", qwen.urls)],
        policies=policies_doc(models=MODELS),
    )
    with running(engines, qwen, gateway):
        yield gateway, engines


def client(gateway: Gateway, key: str = TEST_KEY, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=kwargs.pop("max_retries", 0), **kwargs)


def test_chat_non_streamed_sync(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=MESSAGES,
        max_tokens=12,
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.model == "llama-3.1-8b"  # the alias resolved to the public model that served
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(tokenization.chat_prompt_ids(MESSAGES))
    assert 1 <= completion.usage.completion_tokens <= 12
    assert raw.headers["x-request-id"]
    assert raw.headers["x-tokenway-endpoint"].startswith("llama/")
    assert raw.headers["x-tokenway-model"] == "llama-3.1-8b"


def test_client_request_id_is_kept(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="llama-3.1-8b", messages=MESSAGES, max_tokens=2, extra_headers={"x-request-id": "my-id-42"}
    )
    assert raw.headers["x-request-id"] == "my-id-42"


async def test_chat_streamed_async_with_usage(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0) as aclient:
        stream = await aclient.chat.completions.create(
            model="llama-3.1-8b",
            messages=MESSAGES,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
    assert text
    assert usage is not None and usage.prompt_tokens == len(tokenization.chat_prompt_ids(MESSAGES))
    assert usage.completion_tokens == len(tokenization.encode(text))  # the simulated engine's words: a token each


def test_stream_without_usage_gets_no_usage_chunk(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    chunks = list(
        client(gateway).chat.completions.create(
            model="llama-3.1-8b",
            messages=MESSAGES,
            max_tokens=8,
            stream=True,
        )
    )
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.model == "llama-3.1-8b" for c in chunks)


def test_answers_carry_no_engine_only_fields(fleet: tuple[Gateway, SimEngines]) -> None:
    # the simulated engine writes vLLM's own fields (`stop_reason`, `prompt_logprobs`, `kv_transfer_params`):
    # a strict client refuses them, so the gateway's answers, unary and streamed, must not carry them
    gateway, _ = fleet
    engine_only = ("stop_reason", "prompt_logprobs", "kv_transfer_params", "token_ids", "prompt_token_ids")
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="llama-3.1-8b", messages=MESSAGES, max_tokens=8, stop=["the"]
    )
    answer = json.loads(raw.text)
    assert not [name for name in engine_only if name in answer or name in answer["choices"][0]], answer
    with client(gateway).chat.completions.with_streaming_response.create(
        model="llama-3.1-8b", messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True}
    ) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: {")]
    assert events and not [e for e in events if any(f'"{name}"' in e for name in engine_only)], events


def test_completions_endpoint(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    completion = client(gateway).completions.create(model="llama-3.1-8b", prompt="Once upon a time", max_tokens=5)
    assert completion.choices[0].text
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(tokenization.encode("Once upon a time"))


def test_models_lists_what_the_key_may_use(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    everything = {m.id for m in client(gateway).models.list()}
    assert {"llama-3.1-8b", "gpt-4o-mini", "qwen2.5-7b"} <= everything
    limited = {m.id for m in client(gateway, OTHER_KEY).models.list()}
    assert "qwen2.5-7b" not in limited and "llama-3.1-8b" in limited


@pytest.mark.parametrize(
    ("key", "model", "body", "error"),
    [
        pytest.param("sk-wrong", "llama-3.1-8b", {}, openai.AuthenticationError, id="unknown-key"),
        pytest.param(TEST_KEY, "no-such-model", {}, openai.NotFoundError, id="unknown-model"),
        pytest.param(OTHER_KEY, "qwen2.5-7b", {}, openai.PermissionDeniedError, id="model-not-allowed"),
        pytest.param(TEST_KEY, "llama-3.1-8b", {"max_tokens": -3}, openai.BadRequestError, id="bad-max-tokens"),
        pytest.param(TEST_KEY, "llama-3.1-8b", {"stream": "yes"}, openai.BadRequestError, id="bad-stream-type"),
    ],
)
def test_errors_raise_the_right_exception(
    fleet: tuple[Gateway, SimEngines], key: str, model: str, body: dict[str, Any], error: type[Exception]
) -> None:
    gateway, _ = fleet
    with pytest.raises(error) as caught:
        client(gateway, key).chat.completions.create(model=model, messages=MESSAGES, extra_body=body)
    assert isinstance(caught.value, openai.APIStatusError)
    assert caught.value.response.headers.get("x-request-id")
    payload = caught.value.response.json()
    assert set(payload["error"]) == {"message", "type", "param", "code"}


def test_missing_key_and_x_api_key(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, _ = fleet
    import json
    import urllib.request

    body = json.dumps({"model": "llama-3.1-8b", "messages": MESSAGES, "max_tokens": 2}).encode()
    missing = urllib.request.Request(gateway.base_url + "/chat/completions", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(missing, timeout=10)
    assert caught.value.code == 401
    assert json.loads(caught.value.read())["error"]["code"] == "invalid_api_key"
    with_header = urllib.request.Request(
        gateway.base_url + "/chat/completions", data=body, method="POST", headers={"x-api-key": TEST_KEY}
    )
    with urllib.request.urlopen(with_header, timeout=10) as response:
        assert response.status == 200


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        pytest.param(b"{not json", None, id="malformed-json"),
        pytest.param(b'{"messages": []}', None, id="missing-model"),
        pytest.param(b'{"model": "llama-3.1-8b"}', None, id="missing-messages"),
    ],
)
def test_malformed_bodies_get_400(fleet: tuple[Gateway, SimEngines], payload: bytes, code: str | None) -> None:
    gateway, _ = fleet
    import json
    import urllib.request

    request = urllib.request.Request(
        gateway.base_url + "/chat/completions",
        data=payload,
        method="POST",
        headers={"Authorization": f"Bearer {TEST_KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400
    error = json.loads(caught.value.read())["error"]
    assert error["type"] == "invalid_request_error"


def test_client_disconnect_mid_stream_aborts_the_engine_request(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b", time_scale=1)
    gateway = gateway_factory(pools=[static_pool("llama", "llama-3.1-8b", engines.urls)], policies=policies_doc())
    stream = client(gateway).chat.completions.create(
        model="llama-3.1-8b",
        messages=MESSAGES,
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    aborted = 0.0
    while time.monotonic() < deadline:
        aborted = metric_total(engines.urls[0], "vllm:request_success_total", finished_reason="abort")
        if aborted:
            break
        time.sleep(0.1)
    assert aborted == 1
    assert metric_total(engines.urls[0], "vllm:num_requests_running") == 0


def test_body_too_large_gets_413(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b")
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(),
        server={"max_body_bytes": 4096},
    )
    big = [{"role": "user", "content": "x" * 10_000}]
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model="llama-3.1-8b", messages=big)  # type: ignore[arg-type]
    assert caught.value.status_code == 413
    assert caught.value.response.json()["error"]["code"] == "request_too_large"
    # the gateway still serves normal requests
    assert client(gateway).chat.completions.create(model="llama-3.1-8b", messages=MESSAGES, max_tokens=2).choices


def test_slow_clients_and_huge_headers_are_cut_off_without_harming_others(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b")
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(),
        server={"request_read_timeout_s": 1.0, "max_header_bytes": 2048},
    )
    # a client that never finishes its headers
    slow_headers = socket.create_connection(("127.0.0.1", gateway.port))
    slow_headers.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    # a client that announces a body and never sends it
    slow_body = socket.create_connection(("127.0.0.1", gateway.port))
    slow_body.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 500\r\nAuthorization: Bearer " + TEST_KEY.encode() + b'\r\n\r\n{"model"'
    )
    # meanwhile, others are served
    assert client(gateway).chat.completions.create(model="llama-3.1-8b", messages=MESSAGES, max_tokens=2).choices
    for sock in (slow_headers, slow_body):
        sock.settimeout(15)
        data = b""
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        sock.close()
        assert not data or data.startswith(b"HTTP/1.1 408") or data.startswith(b"HTTP/1.1 4")
    # a header line over the limit is refused
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(
            model="llama-3.1-8b", messages=MESSAGES, max_tokens=2, extra_headers={"x-big": "y" * 5000}
        )
    assert 400 <= caught.value.status_code < 500
    assert client(gateway).chat.completions.create(model="llama-3.1-8b", messages=MESSAGES, max_tokens=2).choices


def test_sigterm_drains_in_flight_streams(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b", time_scale=2)
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(),
        server={"drain_timeout_s": 30},
    )
    stream = client(gateway).chat.completions.create(
        model="llama-3.1-8b",
        messages=MESSAGES,
        max_tokens=60,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    first = next(iter(stream))
    assert first is not None
    import signal

    gateway.proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    usage = [c.usage for c in rest if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 60
    assert gateway.proc.wait(30) == 0


async def test_concurrent_async_clients(fleet: tuple[Gateway, SimEngines]) -> None:
    gateway, engines = fleet
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0) as aclient:
        results = await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model="llama-3.1-8b", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4
                )
                for i in range(24)
            ]
        )
    assert all(r.choices for r in results)
    served = [metric_total(url, "vllm:request_success_total") for url in engines.urls]
    assert all(count > 0 for count in served)  # both replicas took work


def test_openai_client_retries_our_503_until_a_backend_is_ready(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    """A pool with no ready endpoint answers 503 `no_healthy_backend` + retry-after; the client waits and
    retries, and succeeds once the engine (which takes a few seconds to start listening) is ready."""
    ports = free_ports(1)
    url = f"http://127.0.0.1:{ports[0]}"
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", [url])],
        policies=policies_doc(),
        wait_ready=False,
        backends={"health_interval_s": 0.2},
    )
    status, body = http_get(gateway.url + "/readyz")
    assert status == 503 and "llama" in body
    with pytest.raises(openai.InternalServerError) as caught:
        client(gateway).chat.completions.create(model="llama-3.1-8b", messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "1"
    assert caught.value.response.json()["error"]["code"] == "no_healthy_backend"
    engines = start_sim(
        tmp_path,
        count=1,
        served_model_name="llama-3.1-8b",
        args=["--startup-delay-s", "1.5"],
        port=ports[0],
        wait=False,
    )
    try:
        raw = client(gateway, max_retries=8).chat.completions.with_raw_response.create(
            model="llama-3.1-8b", messages=MESSAGES, max_tokens=2
        )
        assert raw.parse().choices
        # every retry the client took answered a 503 of ours (and the first call above one more)
        refused = metric_total(gateway.url, "tokenway_requests_total", http_status="503")
        assert raw.retries_taken > 0 and refused == raw.retries_taken + 1
    finally:
        engines.stop()


def test_retry_moves_the_request_to_another_endpoint_when_one_refuses(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    first = sim_factory(count=1, served_model_name="llama-3.1-8b")
    second = sim_factory(count=1, served_model_name="llama-3.1-8b")
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", [first.urls[0], second.urls[0]])],
        policies=policies_doc(),
        backends={"health_interval_s": 600, "ejection": {"consecutive_failures": 100}},
        routing={"pools": {"llama": {"router": "round-robin"}}},  # blind to load: it will pick the dead one
    )
    first.proc.kill()  # refuses connections from now on; active checks won't notice for minutes
    first.proc.wait(10)
    served_by = []
    for _ in range(6):
        raw = client(gateway).chat.completions.with_raw_response.create(
            model="llama-3.1-8b", messages=MESSAGES, max_tokens=2
        )
        assert raw.parse().choices
        served_by.append(raw.headers["x-tokenway-endpoint"])
    assert set(served_by) == {"llama/both-s1"}
    assert "failed before the first byte" in gateway.log()

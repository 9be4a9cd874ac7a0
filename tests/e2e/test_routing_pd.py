"""Prefill/decode disaggregation end to end: the gateway's two-leg handshake over simulated engines.

A long prompt is prefilled on the prefill engine (`max_tokens=1`, `do_remote_decode`) and decoded on
the decode engine, which pulls the KV blocks and so reports all but the last prompt token as cached.
A short one (or a follow-up whose prefix the decode engine already holds) is prefilled in place.
A prefill leg that fails falls back to prefill on the decode engine and the request still succeeds.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends import tokenization
from tests.support.procs import (
    TEST_KEY,
    Gateway,
    SimEngines,
    free_port,
    http_get,
    running,
    start_gateway,
)

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
DEBUG = {"x-tokenway-debug": "1"}


@pytest.fixture(scope="module")
def pd_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A launched pool with one prefill and one decode replica (default PD settings: 512 uncached)."""
    workdir = tmp_path_factory.mktemp("routing-pd")
    pool = {
        "name": "pd", "model": MODEL, "engine": "sim", "preset": "llama-3.1-8b@h100",
        "roles": {"prefill": 1, "decode": 1}, "kv_transfer": KV_TRANSFER,
        "extra_args": ["--time-scale", "10"], "ready_timeout_s": 60,
    }  # fmt: skip
    backends = {
        "log_dir": str(workdir / "logs"), "run_dir": str(workdir / "run"), "port_base": free_port(),
        "kv_transfer_port_base": free_port(), "ready_poll_interval_s": 0.1,
    }  # fmt: skip
    gateway = start_gateway(workdir / "gw", pools=[pool], backends=backends)
    with running(gateway):
        wait_all_ready(gateway)
        yield gateway


def wait_all_ready(gateway: Gateway, timeout_s: float = 60.0) -> None:
    """/readyz answers 200 once any endpoint of each pool is ready; a PD pool needs both roles."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = http_get(gateway.url + "/admin/backends")
        assert status == 200, body
        states = [e["state"] for p in json.loads(body)["pools"] for e in p["endpoints"]]
        if states and all(s == "ready" for s in states):
            return
        assert time.monotonic() < deadline, f"endpoints not ready: {states}"
        time.sleep(0.05)


def long_text(tag: str, words: int = 500) -> str:
    return " ".join(f"{tag}-{i}" for i in range(words))


def messages(prefix: str, question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": prefix}, {"role": "user", "content": question}]


def route_field(headers: Any, name: str) -> str | None:
    for part in headers["x-tokenway-route"].split("; "):
        if part.startswith(name + "="):
            return str(part.split("=", 1)[1])
    return None


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)


def ask(gateway: Gateway, msgs: list[ChatCompletionMessageParam], max_tokens: int = 8) -> tuple[Any, Any]:
    """(headers, completion) of a non-streamed request with the routing debug header."""
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, max_tokens=max_tokens, extra_headers=DEBUG,
    )  # fmt: skip
    return raw.headers, raw.parse()


def ask_streamed(gateway: Gateway, msgs: list[ChatCompletionMessageParam], max_tokens: int = 8) -> tuple[Any, str, Any]:
    """(headers, text, usage) of a streamed request with `include_usage`."""
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_headers=DEBUG,
    )  # fmt: skip
    text, usage = "", None
    for chunk in raw.parse():
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    return raw.headers, text, usage


def cached(usage: Any) -> int:
    details = usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def test_long_prompt_is_disaggregated(pd_gateway: Gateway) -> None:
    headers, completion = ask(pd_gateway, messages(long_text(uuid.uuid4().hex[:8]), "Summarise."))
    assert completion.choices[0].message.content
    assert headers["x-tokenway-endpoint"] == "pd/decode-0"
    assert route_field(headers, "pd") == "disaggregated"
    assert route_field(headers, "prefill") == "pd/prefill-0"
    # the decode engine pulled the prefilled KV: every prompt token but the last was cached for it
    usage = completion.usage
    assert usage.prompt_tokens > 1024
    assert cached(usage) == usage.prompt_tokens - 1
    assert usage.completion_tokens == len(tokenization.encode(completion.choices[0].message.content))


def test_long_prompt_is_disaggregated_when_streamed(pd_gateway: Gateway) -> None:
    headers, text, usage = ask_streamed(pd_gateway, messages(long_text(uuid.uuid4().hex[:8]), "Stream it."))
    assert text
    assert headers["x-tokenway-endpoint"] == "pd/decode-0"
    assert route_field(headers, "pd") == "disaggregated"
    assert usage is not None and usage.completion_tokens == len(tokenization.encode(text))
    assert cached(usage) == usage.prompt_tokens - 1


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_short_prompt_is_prefilled_on_the_decode_engine(pd_gateway: Gateway, stream: bool) -> None:
    msgs = messages("You answer briefly.", f"Name a colour ({uuid.uuid4().hex[:6]}).")
    if stream:
        headers, text, usage = ask_streamed(pd_gateway, msgs)
        assert text
    else:
        headers, completion = ask(pd_gateway, msgs)
        usage = completion.usage
    assert headers["x-tokenway-endpoint"] == "pd/decode-0"
    assert route_field(headers, "pd") == "few-uncached"
    assert route_field(headers, "prefill") is None
    assert cached(usage) < usage.prompt_tokens - 1


def test_follow_up_turn_reuses_the_decode_engines_cache_without_a_prefill_leg(pd_gateway: Gateway) -> None:
    prefix = long_text(uuid.uuid4().hex[:8])
    headers, first = ask(pd_gateway, messages(prefix, "First turn."))
    assert route_field(headers, "pd") == "disaggregated"
    headers, second = ask(pd_gateway, messages(prefix, "Second turn, same long context."))
    assert route_field(headers, "pd") == "few-uncached"
    assert cached(second.usage) >= first.usage.prompt_tokens - 32


@pytest.fixture
def static_pd(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> tuple[Gateway, SimEngines]:
    """Static prefill and decode engines (separate processes) behind a gateway whose active health
    checks run once at startup and not again for the test's lifetime."""
    args = ["--kv-transfer-config", json.dumps(KV_TRANSFER)]
    prefill = sim_factory(count=1, served_model_name=MODEL, args=args)
    decode = sim_factory(count=1, served_model_name=MODEL, args=args)
    pool = {
        "name": "spd", "model": MODEL, "engine": "vllm",
        "endpoints": [{"url": prefill.urls[0], "role": "prefill"}, {"url": decode.urls[0], "role": "decode"}],
    }  # fmt: skip
    gateway = gateway_factory(pools=[pool], backends={"health_interval_s": 3600})
    return gateway, prefill


def test_failed_prefill_leg_falls_back_to_local_prefill(static_pd: tuple[Gateway, SimEngines]) -> None:
    gateway, prefill = static_pd
    headers, completion = ask(gateway, messages(long_text(uuid.uuid4().hex[:8]), "Healthy pair."))
    assert route_field(headers, "pd") == "disaggregated"
    assert cached(completion.usage) == completion.usage.prompt_tokens - 1
    # the prefill engine dies; the gateway still believes it ready (no health check until much later)
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait(10)
    assert http_get(prefill.urls[0] + "/health")[0] == 0
    headers, completion = ask(gateway, messages(long_text(uuid.uuid4().hex[:8]), "Prefill is gone."))
    assert completion.choices[0].message.content
    assert headers["x-tokenway-endpoint"] == "spd/decode-s1"
    assert route_field(headers, "pd") == "disaggregated"  # decided so; the prefill leg then failed
    assert cached(completion.usage) == 0  # the decode engine computed the whole prompt itself
    headers, text, usage = ask_streamed(gateway, messages(long_text(uuid.uuid4().hex[:8]), "Streamed, too."))
    assert text
    assert usage is not None and cached(usage) == 0
    assert "PD prefill leg on spd/prefill-s0 failed" in gateway.log()

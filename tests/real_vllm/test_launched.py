# mypy: disable-error-code="union-attr,operator"
"""A real `vllm serve` launched and supervised by tokenway: one engine, shared by this module's tests.

In order: the engine's metrics and the tokenizer as /admin/backends shows them; cached input billed
from the engine's own numbers; prompt counts equal to the engine's; the precise index against real KV
events (a shared-prefix pair, then eviction); a client abort; `kill -9` of vLLM's API server
followed by a clean restart; SIGTERM of the gateway draining a stream to its end, leaving nothing.
"""

from __future__ import annotations

import ast
import http.client
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from backends.process import group_has_live_members
from policies.policy import hash_key
from tests.real_vllm.conftest import (
    MODEL,
    START_TIMEOUT_S,
    admin_backends,
    backends_settings,
    engine_metric,
    launched_pool,
    ledger_entries,
)
from tests.support.polling import wait_for
from tests.support.procs import OTHER_KEY, TEST_KEY, Gateway, start_gateway

pytestmark = pytest.mark.e2e

BLOCKS = 24  # --num-gpu-blocks-override: 24 x 128 tokens, so a few long prompts evict the rest
PRICE = {"input_per_mtok": 1.0, "cached_input_per_mtok": 0.25, "output_per_mtok": 2.0}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter in einer Stadt, 天气",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {}, "strict": True}},
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("launched")
    pool = launched_pool(model_dir, kv_events={"enabled": True}, extra_args=["--num-gpu-blocks-override", str(BLOCKS)])
    policies = {
        "tenants": {"t1": {}, "t2": {}},
        "keys": [
            {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
            {"id": "k2", "tenant": "t2", "sha256": hash_key(OTHER_KEY)},
        ],
        "models": {MODEL: {"context_length": 2048, "price": PRICE}},
    }
    gw = start_gateway(
        workdir,
        pools=[pool],
        policies=policies,
        ready_timeout_s=START_TIMEOUT_S,
        routing={"prefix_index": {"mode": "precise", "advanced": {"speculative_ttl_s": 0}}},
        backends=backends_settings(restart_backoff_s=0.5, term_grace_s=30, health_interval_s=0.5),
        ledger={"commit_interval_ms": 20},
        server={"drain_timeout_s": 300},
    )
    try:
        yield gw
    finally:
        if gw.proc.poll() is None:
            gw.stop()
        print(gw.log()[-3000:])


def client(gw: Gateway, key: str = TEST_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=300)


def endpoint_status(gw: Gateway) -> dict[str, Any]:
    (pool,) = admin_backends(gw.url)["pools"]
    (endpoint,) = pool["endpoints"]
    return {**endpoint, "tokenizer": pool["tokenizer"]}


def engine_url(gw: Gateway) -> str:
    return str(endpoint_status(gw)["url"])


def chat(gw: Gateway, messages: list[Any], key: str = TEST_KEY, **extra: Any) -> tuple[dict[str, str], Any]:
    raw = client(gw, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2, extra_headers={"x-tokenway-debug": "1"}, **extra
    )
    return dict(raw.headers), raw.parse()


def header_part(headers: dict[str, str], header: str, name: str) -> str:
    for part in headers[header].split("; "):
        if part.startswith(name + "="):
            return part.split("=", 1)[1]
    raise AssertionError(f"{name} not in {headers[header]}")


def cached(completion: Any) -> int:
    details = completion.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_admin_backends_shows_the_real_engines_metrics_and_tokenizer(gateway: Gateway) -> None:
    status = wait_for(lambda: (s := endpoint_status(gateway))["block_size"] and s, what="a scrape", timeout_s=60)
    assert status["state"] == "ready"
    # Not passed on the command line: the engine chose it, vllm:cache_config_info reports it.
    assert (status["block_size"], status["num_gpu_blocks"]) == (128, BLOCKS)
    assert status["sleep_state"] == "awake"
    assert set(status["waiting_by_reason"]) == {"capacity", "deferred"}
    assert status["tokenizer"]["source"] == "model" and status["tokenizer"]["exact"] is True
    argv = engine_argv(gateway)
    assert "--block-size" not in argv and "--gpu-memory-utilization" not in argv
    assert "--enable-prompt-tokens-details" in argv


def test_kv_event_sockets_listen_on_loopback_only(gateway: Gateway) -> None:
    port = kv_events_port(gateway)
    assert wait_for(lambda: not _bindable("127.0.0.1", port), what="the publisher to bind", timeout_s=60)
    # Bound to 127.0.0.1 alone, not `*`: another loopback address can still take the port.
    assert _bindable("127.0.0.2", port)


def engine_argv(gw: Gateway) -> list[str]:
    """The engine's command line, as the supervisor wrote it at the head of the replica's log."""
    log = Path(gw.workdir, "var", "log", "engines", "tiny.both-0.log").read_text(errors="replace")
    line = next(line for line in log.splitlines() if line.startswith("=== argv: "))
    argv: list[str] = ast.literal_eval(line[len("=== argv: ") :])
    return argv


def kv_events_port(gw: Gateway) -> int:
    argv = engine_argv(gw)
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events["endpoint"].startswith("tcp://[::ffff:127.0.0.1]:")
    return int(events["endpoint"].rsplit(":", 1)[1])


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def test_a_repeated_prompt_bills_the_engines_cached_tokens(gateway: Gateway) -> None:
    url = engine_url(gateway)
    before = engine_metric(url, "vllm:prompt_tokens_cached_total")
    messages = [{"role": "user", "content": words(uuid.uuid4().hex[:6], 80)}]
    _, first = chat(gateway, messages)
    headers, second = chat(gateway, messages)
    assert cached(first) == 0 and cached(second) > 0 and cached(second) % 128 == 0
    assert engine_metric(url, "vllm:prompt_tokens_cached_total") - before == cached(second)
    request_id = headers["x-request-id"]
    entry = wait_for(lambda: next((e for e in ledger_entries(gateway.workdir) if e["request_id"] == request_id), None),
                     what="the ledger line",
                     timeout_s=60)  # fmt: skip
    assert entry["cached_input_tokens"] == cached(second)
    usage = second.usage
    expected = (usage.prompt_tokens - cached(second)) * 1.0 + cached(second) * 0.25 + usage.completion_tokens * 2.0
    assert entry["cost_usd"] == pytest.approx(expected / 1e6)
    wait_for(lambda: endpoint_status(gateway)["prompt_tokens_cached"] >= cached(second), what="a scrape", timeout_s=60)


def test_another_tenant_resending_a_prompt_finds_nothing_of_it_in_the_engines_cache(gateway: Gateway) -> None:
    """The gateway gives each tenant its own `cache_salt`, which the real engine mixes into its block hashes:
    a tenant cannot learn from `cached_tokens` what another sent (and its own repeats still hit)."""
    messages = [{"role": "user", "content": words(uuid.uuid4().hex[:6], 80)}]
    chat(gateway, messages)
    _, again = chat(gateway, messages)
    _, other = chat(gateway, messages, key=OTHER_KEY)
    assert cached(again) > 0
    assert cached(other) == 0


PROMPTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat-cjk-emoji": ("chat", {"messages": [{"role": "system", "content": "Réponds en français."},
                                             {"role": "user", "content": "東京の天気はどうですか？今日は寒い 😀"}]}),  # noqa: RUF001
    "chat-tools": ("chat", {"messages": [{"role": "user", "content": "Wetter in München?"}], "tools": TOOLS,
                            "tool_choice": "none"}),
    "chat-tool-history": ("chat", {"messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "18°C, sonnig"}]},
    ], "tools": TOOLS, "tool_choice": "none"}),
    "chat-parts-developer": ("chat", {"messages": [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "ünïcödé"}]},
    ]}),
    "completion-non-ascii": ("completions", {"prompt": "Der Größenwahn — 日本語のテキスト and English"}),
    "completion-ids": ("completions", {"prompt": [5, 6, 7, 8, 9]}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PROMPTS))
def test_the_gateways_prompt_count_equals_the_engines(gateway: Gateway, case: str) -> None:
    api, body = PROMPTS[case]
    if api == "chat":
        headers, response = chat(gateway, body["messages"], **{k: v for k, v in body.items() if k != "messages"})
    else:
        raw = client(gateway).completions.with_raw_response.create(
            model=MODEL, max_tokens=2, extra_headers={"x-tokenway-debug": "1"}, **body
        )
        headers, response = dict(raw.headers), raw.parse()
    counted, source = headers["x-tokenway-prompt-tokens"].split(";source=")
    assert (int(counted), source) == (response.usage.prompt_tokens, "model")


def test_responses_and_messages_count_their_prompt_as_the_engine_does(gateway: Gateway) -> None:
    """The Responses and Anthropic Messages APIs pass natively to vLLM; the gateway counts the chat
    they render as with the model's own tokenizer, so admission sees the engine's number."""
    raw = client(gateway).responses.with_raw_response.create(
        model=MODEL, instructions="Réponds en français.", input="東京の天気は 😀", max_output_tokens=2,
        extra_headers={"x-tokenway-debug": "1"},
    )  # fmt: skip
    counted, source = raw.headers["x-tokenway-prompt-tokens"].split(";source=")
    assert (int(counted), source) == (raw.parse().usage.input_tokens, "model")
    anthropic_client = anthropic.Anthropic(base_url=gateway.url, api_key=TEST_KEY, max_retries=0, timeout=300)
    reply = anthropic_client.messages.with_raw_response.create(
        model=MODEL, system="Be terse.", max_tokens=2, extra_headers={"x-tokenway-debug": "1"},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Größe? ünïcödé"}]}],
    )  # fmt: skip
    counted, source = reply.headers["x-tokenway-prompt-tokens"].split(";source=")
    usage = reply.parse().usage
    engine_prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert (int(counted), source) == (engine_prompt, "model")


def test_no_prompt_was_counted_differently_from_the_engine(gateway: Gateway) -> None:
    audit = endpoint_status(gateway)["tokenizer"]["audit"]
    assert audit["requests"] >= len(PROMPTS) and audit["mismatches"] == 0, audit


def test_a_prompt_too_long_for_the_model_is_refused_by_the_gateway(gateway: Gateway) -> None:
    # ~1,400 characters of CJK: under 2,048 tokens in cl100k, far over in the model's vocabulary.
    text = "東京の天気はどうですか" * 130
    with pytest.raises(openai.BadRequestError) as raised:
        client(gateway).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                max_tokens=2)  # fmt: skip
    assert raised.value.code == "context_length_exceeded"  # the gateway's own check, not the engine's 400
    assert "maximum context length is 2048 tokens" in raised.value.message


def test_the_precise_index_matches_the_engine_and_forgets_evicted_blocks(gateway: Gateway) -> None:
    prefix = words(uuid.uuid4().hex[:6], 120)

    def ask(question: str) -> tuple[int, int]:
        headers, response = chat(
            gateway, [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
        )
        return int(header_part(headers, "x-tokenway-route", "cached")), cached(response)

    def blocks() -> int:
        return int(endpoint_status(gateway)["precise_index"]["blocks"])

    def events() -> int:
        return int(endpoint_status(gateway)["kv_events"]["events"])

    # the index may hold earlier tests' blocks already: wait for events this request caused (nothing
    # else runs meanwhile, and the engine publishes a step's stored and removed blocks together)
    before = events()
    assert ask("first question") == (0, 0)
    wait_for(lambda: blocks() > 0 and events() > before, what="BlockStored events", timeout_s=60)
    estimate, engine = ask("second question")
    assert estimate == engine and engine >= 256  # the shared prefix, in the engine's 128-token blocks
    evicting = events()
    for i in range(5):  # other long prompts push the prefix out of 24 blocks
        chat(gateway, [{"role": "user", "content": words(f"evict{i}x{uuid.uuid4().hex[:4]}", 100)}])
    # the engine publishes a step's events after its answer may have gone out: wait until the index has
    # had new events and they stopped coming (two reads half a second apart agree), not only for the
    # first of them (comparing the event count with a block count, as this wait did, let a third question
    # be routed before the prefix's BlockRemoved events arrived)
    seen = [evicting]

    def settled() -> bool:
        now = events()
        quiet, seen[0] = now == seen[0] and now > evicting, now
        return quiet and blocks() <= BLOCKS

    wait_for(settled, what="BlockRemoved events, settled", timeout_s=60, interval_s=0.5)
    assert ask("third question") == (0, 0)


def test_a_client_disconnect_stops_the_engine_request(gateway: Gateway) -> None:
    """The engine stops short of max_tokens once the client is gone.

    Judged by the engine's own token counter settling below max_tokens, not by catching its
    `num_requests_running` gauge at 1 (a fast engine can be done between two reads of a gauge).
    """
    url = engine_url(gateway)
    max_tokens = 1900  # the context is 2,048: about nine seconds of this engine on a 2-core machine

    def generated() -> float:
        return engine_metric(url, "vllm:generation_tokens_total")

    def settled(readings: list[float]) -> bool:  # the counter unchanged over a second with nothing running
        readings.append(generated())
        steady = len(readings) > 5 and readings[-1] == readings[-6]
        return steady and engine_metric(url, "vllm:num_requests_running") == 0

    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    # A starved API-server process merges the engine's outputs: a whole answer can reach the gateway as
    # one chunk (seen once: first token at 3.73 s of a 3.75 s request), and then the client had nothing
    # to leave in the middle of. Such a try says nothing about the abort, and whether it happened cannot
    # be read at the moment the client leaves (the engine's counter lags its steps), so a try that
    # produced the whole answer is tried again: an abort that does not work never stops short.
    for _ in range(3):
        before = generated()
        connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=120)
        headers = {"Authorization": f"Bearer {TEST_KEY}", "Content-Type": "application/json"}
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        response = connection.getresponse()
        assert response.status == 200
        lines = [response.readline() for _ in range(5)]
        assert any(b'"content":"' in line for line in lines), lines  # tokens came from the engine
        connection.close()  # the client goes away mid-stream
        readings: list[float] = []
        wait_for(partial(settled, readings), what="the engine's token counter to settle", timeout_s=60)
        if readings[-1] - before < max_tokens:
            break
    assert 0 < readings[-1] - before < max_tokens, (before, readings)
    status = wait_for(lambda: (s := endpoint_status(gateway))["running"] == 0 and s, what="a scrape", timeout_s=60)
    assert status["inflight_requests"] == 0


def test_kill_9_of_the_api_server_is_followed_by_a_clean_restart(gateway: Gateway) -> None:
    before = endpoint_status(gateway)
    leader = int(before["pid"])
    os.kill(leader, signal.SIGKILL)
    wait_for(lambda: endpoint_status(gateway)["state"] != "ready", what="the crash to be seen", timeout_s=60)
    # EngineCore and the worker were in the API server's group: killed, not left holding the ports.
    wait_for(lambda: not group_has_live_members(leader), timeout_s=60, what="the old group to be gone")
    after = wait_for(lambda: (s := endpoint_status(gateway))["state"] == "ready" and s,
                     timeout_s=START_TIMEOUT_S, what="the restart")  # fmt: skip
    assert after["restarts"] == before["restarts"] + 1 and after["pid"] != leader
    assert after["url"] == before["url"]  # same port
    _, response = chat(gateway, [{"role": "user", "content": "still there?"}])
    assert response.usage.completion_tokens == 2


def test_sigterm_drains_a_stream_to_its_end_and_leaves_no_engine_behind(gateway: Gateway) -> None:
    leader = int(endpoint_status(gateway)["pid"])
    received: list[str] = []
    finished: list[str | None] = []
    usage: list[int] = []

    def consume() -> None:
        stream = client(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=300, stream=True,
            extra_body={"ignore_eos": True, "min_tokens": 300}, stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usage.append(chunk.usage.completion_tokens)
            if chunk.choices:
                received.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].finish_reason:
                    finished.append(chunk.choices[0].finish_reason)

    reader = threading.Thread(target=consume)
    reader.start()
    wait_for(lambda: len(received) >= 3, what="the stream to start", timeout_s=60)
    gateway.proc.send_signal(signal.SIGTERM)
    reader.join(600)
    # Every token (deltas may join tokens that split a UTF-8 character), the usage chunk, a clean end.
    assert finished == ["length"] and usage == [300]
    assert gateway.proc.wait(300) == 0
    deadline = time.monotonic() + 60
    while group_has_live_members(leader) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_has_live_members(leader), "the engine outlived the gateway"

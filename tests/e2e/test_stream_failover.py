"""Failover inside a stream (docs/agents.md): a stream its engine cuts mid-answer continues on the
fallback model, one stream for the client in its own grammar, one ledger record per leg.

Two models, each on its own engine: `big` (opted in with `stream_failover`, falls back to `small`)
on an engine that fails after three chunks (`tests/support/cut_engine.py`: a reset, a truncated body
or an error event), `small` on one that answers whole. The official clients (openai's chat and
Responses streams, anthropic's Messages stream) each read one complete stream with the marker; the
ledger has one record per leg, priced at its model; no reservation is left open. A model that did not
opt in, a fallback refused by its budget, and a tool call under way at the cut end with the error
event, as before. The last test cuts a simulated engine by killing it mid-answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.ledger.reader import iter_entries
from policies.policy import hash_key
from tests.support.polling import wait_for
from tests.support.procs import (
    REPO,
    TEST_KEY,
    Gateway,
    free_port,
    http_get,
    start_gateway,
    static_pool,
    stop_process,
    wait_http,
)

pytestmark = pytest.mark.e2e

ADMIN = "failover-admin"
BIG, SMALL, PLAIN = "big", "small", "plain"
PRICES = {BIG: (3.0, 15.0), SMALL: (0.2, 0.6), PLAIN: (1.0, 1.0)}  # USD per million tokens: input, output
CUT_AT = 3  # content chunks the first engine sends before it fails
SMALL_CHUNKS = 4  # content chunks the fallback's engine sends


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    url: str

    def bodies(self) -> list[dict[str, Any]]:
        status, text = http_get(self.url + "/_bodies")
        assert status == 200, text
        return list(json.loads(text))

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def start(*args: str) -> Engine:
        port = free_port()
        argv = [sys.executable, "-m", "tests.support.cut_engine", "--port", str(port), *args]
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engine = Engine(proc, f"http://127.0.0.1:{port}")
        started.append(engine)
        wait_http(engine.url + "/health", proc=proc)
        return engine

    yield start
    for engine in reversed(started):
        engine.stop()


def model(name: str, **extra: Any) -> dict[str, Any]:
    price_in, price_out = PRICES[name]
    return {"price": {"input_per_mtok": price_in, "output_per_mtok": price_out}, "default_max_tokens": 64, **extra}


def setup(
    tmp_path: Path,
    engines: Callable[..., Engine],
    gateways: Callable[..., Gateway],
    *,
    cut: str = "reset",
    tool_call: bool = False,
    budgets: list[dict[str, Any]] | None = None,
) -> tuple[Gateway, Engine, Path]:
    first = engines("--cut-after", str(CUT_AT), "--cut", cut, "--word", "a", *(["--tool-call"] if tool_call else []))
    fallback = engines("--chunks", str(SMALL_CHUNKS), "--word", "b")
    plain = engines("--cut-after", str(CUT_AT), "--word", "p")
    policies = {
        "tenants": {"t1": {}},
        "keys": [{"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)}],
        "models": {
            BIG: model(BIG, stream_failover=True, fallbacks=[SMALL]),
            SMALL: model(SMALL),
            PLAIN: model(PLAIN, fallbacks=[SMALL]),  # not opted in: its cut streams end as before
        },
        "limits": [{"scope": "key", "max_concurrent": 50}],
        "budgets": budgets or [],
    }
    ledger = tmp_path / "usage"
    gateway = gateways(
        pools=[
            static_pool("big", BIG, [first.url]),
            static_pool("small", SMALL, [fallback.url]),
            static_pool("plain", PLAIN, [plain.url]),
        ],
        policies=policies,
        server={"admin_token": ADMIN},
        ledger={"dir": str(ledger), "commit_interval_ms": 20},
    )
    return gateway, fallback, ledger


def records(ledger: Path, stem: str, count: int) -> list[dict[str, Any]]:
    """The ledger's records of request `stem` (its legs), once `count` of them are written."""

    def found() -> list[dict[str, Any]]:
        if not ledger.exists():
            return []
        return [r for r in iter_entries(ledger) if r["request_id"].split(".leg")[0] == stem]

    wait_for(lambda: len(found()) >= count, what=f"{count} ledger records of {stem}", timeout_s=20)
    return sorted(found(), key=lambda r: r.get("leg", 0))


def leases(gateway: Gateway) -> int:
    status, text = http_get(gateway.url + "/admin/status", {"Authorization": f"Bearer {ADMIN}"}, timeout_s=10)
    assert status == 200, text
    return sum(r.get("active", 0) for r in json.loads(text)["limits"] if r.get("kind") == "concurrency")


def cost(name: str, prompt: int, output: int) -> float:
    price_in, price_out = PRICES[name]
    return (prompt * price_in + output * price_out) / 1e6


def check_legs(gateway: Gateway, ledger: Path, stem: str, prompt_tokens: int) -> None:
    """Two records, one per leg, each priced at its own model; nothing left reserved."""
    first, second = records(ledger, stem, 2)
    assert (first["request_id"], first["model"], first["leg"], first["continues"]) == (stem, BIG, 1, None)
    assert (second["request_id"], second["model"], second["leg"]) == (f"{stem}.leg2", SMALL, 2)
    assert second["continues"] == stem and second["fallback_from"] == BIG
    assert first["output_tokens"] == CUT_AT and second["output_tokens"] == SMALL_CHUNKS
    assert first["cost_usd"] == pytest.approx(cost(BIG, first["input_tokens"], CUT_AT))
    assert second["cost_usd"] == pytest.approx(cost(SMALL, second["input_tokens"], SMALL_CHUNKS))
    assert first["input_tokens"] == second["input_tokens"] == prompt_tokens
    assert len(records(ledger, stem, 2)) == 2  # and no third
    wait_for(lambda: leases(gateway) == 0, what="no reservation left open", timeout_s=10)


EXPECTED = "".join(f" a{i + 1}" for i in range(CUT_AT)) + "".join(f" b{i + 1}" for i in range(SMALL_CHUNKS))
MARKER = {"from": BIG, "to": SMALL, "at_tokens": CUT_AT}


@pytest.mark.parametrize("cut", ["reset", "truncate", "error"])
def test_a_chat_stream_continues_on_the_fallback_model(
    tmp_path: Path, engines: Callable[..., Engine], gateway_factory: Callable[..., Gateway], cut: str
) -> None:
    gateway, fallback, ledger = setup(tmp_path, engines, gateway_factory, cut=cut)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    stem = f"failover-{uuid.uuid4().hex[:8]}"
    text, ids, models, markers, usage, finish = "", set(), [], [], None, None
    for chunk in client.chat.completions.create(
        model=BIG,
        messages=[{"role": "user", "content": "Tell me a story."}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-request-id": stem},
    ):
        ids.add(chunk.id)
        extension = (chunk.model_extra or {}).get("tokenway")
        if extension is not None:
            markers.append(extension["failover"])
            continue
        models.append(chunk.model)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == EXPECTED and finish == "stop"
    assert len(ids) == 1  # one stream, one id
    assert markers == [MARKER]
    assert models[0] == BIG and models[-1] == SMALL  # continuation chunks name the model that wrote them
    assert usage is not None and usage.completion_tokens == CUT_AT + SMALL_CHUNKS  # every leg's output
    continuation = fallback.bodies()[-1]
    assert continuation["messages"][-1] == {"role": "assistant", "content": EXPECTED[: len(" a1 a2 a3")]}
    assert continuation["continue_final_message"] is True
    check_legs(gateway, ledger, stem, usage.prompt_tokens)


def test_an_anthropic_stream_continues_as_one_message(
    tmp_path: Path, engines: Callable[..., Engine], gateway_factory: Callable[..., Gateway]
) -> None:
    gateway, _fallback, ledger = setup(tmp_path, engines, gateway_factory)
    client = anthropic.Anthropic(base_url=gateway.url, api_key=TEST_KEY, max_retries=0, timeout=60)
    stem = f"failover-{uuid.uuid4().hex[:8]}"
    kinds: list[str] = []
    with client.messages.stream(
        model=BIG,
        max_tokens=64,
        messages=[{"role": "user", "content": "Tell me a story."}],
        extra_headers={"x-request-id": stem},
    ) as stream:
        kinds.extend(event.type for event in stream)
        message = stream.get_final_message()
    assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == EXPECTED  # type: ignore[union-attr]
    assert message.usage.output_tokens == CUT_AT + SMALL_CHUNKS
    check_legs(gateway, ledger, stem, records(ledger, stem, 2)[0]["input_tokens"])


def test_an_anthropic_raw_stream_carries_the_marker_in_a_ping(
    tmp_path: Path, engines: Callable[..., Engine], gateway_factory: Callable[..., Gateway]
) -> None:
    gateway, _fallback, _ledger = setup(tmp_path, engines, gateway_factory)
    body = httpx.post(
        gateway.base_url + "/messages",
        json={"model": BIG, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
        headers={"x-api-key": TEST_KEY, "anthropic-version": "2023-06-01"},
        timeout=60,
    ).text
    pings = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:") and '"ping"' in line]
    assert {"type": "ping", "tokenway": {"failover": MARKER}} in pings
    assert body.count("event: message_start") == 1 and body.count("event: message_stop") == 1


def test_a_responses_stream_continues_as_one_response(
    tmp_path: Path, engines: Callable[..., Engine], gateway_factory: Callable[..., Gateway]
) -> None:
    gateway, _fallback, ledger = setup(tmp_path, engines, gateway_factory)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    stem = f"failover-{uuid.uuid4().hex[:8]}"
    kinds: list[str] = []
    markers: list[Any] = []
    sequence: list[int] = []
    final: Any = None
    for event in client.responses.create(
        model=BIG, input="Tell me a story.", stream=True, extra_headers={"x-request-id": stem}
    ):
        kind: str = event.type  # tokenway's own event is outside the SDK's literal types
        kinds.append(kind)
        sequence.append(event.sequence_number)
        if kind == "tokenway.failover":
            markers.append((event.model_extra or {})["tokenway"]["failover"])
        if event.type == "response.completed":
            final = event.response
    assert kinds.count("response.created") == 1 and kinds.count("response.output_item.added") == 1
    assert markers == [MARKER]
    assert sequence == list(range(len(sequence)))
    assert final is not None and final.output_text == EXPECTED
    check_legs(gateway, ledger, stem, records(ledger, stem, 2)[0]["input_tokens"])
    with client.responses.stream(model=BIG, input="Again.") as stream:  # the SDK's accumulator reads it too
        for _event in stream:
            pass
        assert stream.get_final_response().output_text == EXPECTED


def test_a_model_that_did_not_opt_in_ends_with_the_error_event(
    tmp_path: Path, engines: Callable[..., Engine], gateway_factory: Callable[..., Gateway]
) -> None:
    gateway, fallback, ledger = setup(tmp_path, engines, gateway_factory)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    stem = f"plain-{uuid.uuid4().hex[:8]}"
    text = ""
    with pytest.raises(openai.APIError, match="the upstream stream failed"):
        for chunk in client.chat.completions.create(
            model=PLAIN, messages=[{"role": "user", "content": "Hi"}], stream=True, extra_headers={"x-request-id": stem}
        ):
            text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text == " p1 p2 p3"
    (record,) = records(ledger, stem, 1)
    assert record["status"] == "error" and "leg" not in record
    assert fallback.bodies() == []  # nothing went to the fallback model
    wait_for(lambda: leases(gateway) == 0, what="no reservation left open", timeout_s=10)


def test_a_fallback_refused_by_its_budget_ends_with_the_error_event(
    tmp_path: Path, engines: Callable[..., Engine], gateway_factory: Callable[..., Gateway]
) -> None:
    budget = {"scope": "model", "match": {"model": SMALL}, "usd_per_day": 0.000001}  # below any leg's estimate
    gateway, fallback, ledger = setup(tmp_path, engines, gateway_factory, budgets=[budget])
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    stem = f"refused-{uuid.uuid4().hex[:8]}"
    with pytest.raises(openai.APIError, match="the upstream stream failed"):
        for _chunk in client.chat.completions.create(
            model=BIG, messages=[{"role": "user", "content": "Hi"}], stream=True, extra_headers={"x-request-id": stem}
        ):
            pass
    (record,) = records(ledger, stem, 1)
    assert record["model"] == BIG and record["status"] == "error" and "leg" not in record
    assert fallback.bodies() == []
    wait_for(lambda: leases(gateway) == 0, what="no reservation left open", timeout_s=10)


def test_a_tool_call_under_way_is_not_spliced(
    tmp_path: Path, engines: Callable[..., Engine], gateway_factory: Callable[..., Gateway]
) -> None:
    gateway, fallback, _ledger = setup(tmp_path, engines, gateway_factory, tool_call=True)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.APIError, match="the upstream stream failed"):
        for _chunk in client.chat.completions.create(
            model=BIG,
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            tools=tools,  # type: ignore[arg-type]
        ):
            pass
    assert fallback.bodies() == []
    wait_for(lambda: leases(gateway) == 0, what="no reservation left open", timeout_s=10)


# --- a simulated engine killed mid-answer ------------------------------------------------------------

SIM_BIG, SIM_SMALL = "llama-3.1-8b", "qwen2.5-7b"
MAX_TOKENS = 300


def test_a_stream_cut_by_a_killed_engine_continues_on_the_fallback_model(tmp_path: Path) -> None:
    """One record per leg; the client reads one stream of the output it asked for."""
    ports = {name: free_port() for name in ("port_base", "kv_events_port_base", "kv_events_replay_port_base",
                                            "kv_transfer_port_base")}  # fmt: skip

    def pool(name: str, model_name: str, preset: str) -> dict[str, Any]:
        return {"name": name, "model": model_name, "engine": "sim", "preset": preset, "replicas": 1,
                "ready_timeout_s": 60}  # fmt: skip

    ledger = tmp_path / "usage"
    gateway = start_gateway(
        tmp_path / "gw",
        pools=[pool("big", SIM_BIG, "llama-3.1-8b@h100"), pool("small", SIM_SMALL, "qwen2.5-7b@h100")],
        policies={
            "tenants": {"t1": {}},
            "keys": [{"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)}],
            "models": {SIM_BIG: {"stream_failover": True, "fallbacks": [SIM_SMALL]}, SIM_SMALL: {}},
        },
        backends={"log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports},
        ledger={"dir": str(ledger), "commit_interval_ms": 20},
    )
    try:
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=120)
        stem = f"killed-{uuid.uuid4().hex[:8]}"
        got: dict[str, Any] = {"chunks": 0, "markers": [], "ids": set(), "usage": None, "finish": None, "error": None}

        def read() -> None:
            try:
                for chunk in client.chat.completions.create(
                    model=SIM_BIG,
                    messages=[{"role": "user", "content": "Tell me a long story."}],
                    max_tokens=MAX_TOKENS,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                    extra_headers={"x-request-id": stem},
                ):
                    got["ids"].add(chunk.id)
                    extension = (chunk.model_extra or {}).get("tokenway")
                    if extension is not None:
                        got["markers"].append(extension["failover"])
                    got["usage"] = chunk.usage or got["usage"]
                    for choice in chunk.choices:
                        got["chunks"] += bool(choice.delta.content)
                        got["finish"] = choice.finish_reason or got["finish"]
            except Exception as exc:
                got["error"] = repr(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_for(lambda: got["chunks"] >= 5, what="the stream to be under way", timeout_s=90)
        _, body = http_get(gateway.url + "/admin/backends")
        (victim,) = next(p for p in json.loads(body)["pools"] if p["name"] == "big")["endpoints"]
        os.killpg(victim["pid"], signal.SIGKILL)
        reader.join(120)
        assert got["error"] is None, got["error"]
        assert got["finish"] == "length" and len(got["ids"]) == 1
        assert got["usage"].completion_tokens == MAX_TOKENS  # the budget held across the legs
        (marker,) = got["markers"]
        assert (marker["from"], marker["to"]) == (SIM_BIG, SIM_SMALL) and 0 < marker["at_tokens"] < MAX_TOKENS
        first, second = records(ledger, stem, 2)
        assert (first["model"], first["leg"], second["model"], second["leg"]) == (SIM_BIG, 1, SIM_SMALL, 2)
        assert second["continues"] == stem
        assert first["output_tokens"] + second["output_tokens"] == MAX_TOKENS
    finally:
        gateway.stop()

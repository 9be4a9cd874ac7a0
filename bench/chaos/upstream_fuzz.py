"""Probe: the gateway in front of an engine that answers anything (hypothesis-drawn answers).

The other fuzz stages send hostile input from the client's side; what an engine answers is input
too, and the gateway parses it to bill (usage), to rename (the model), to count tokens and to find
the first one. Here one engine endpoint is a stand-in that passes vLLM's health probe and answers
each chat request with the answer the example drew: any status, any content type, a chat completion
with fields swapped for any JSON value (usage counts from -5 to 10^12, strings, null), a stream of
server-sent events mixing valid chunks, usage chunks of any shape, lines that are not JSON, a
`[DONE]` or none, cut at random byte offsets, and sometimes the connection dropped mid-answer.
Clients send valid chat requests (streamed or not) with a request id each.

Targets:
- every request answered (an HTTP status; a broken engine is a 502, not a hang or a closed socket),
  and the log shows no request meeting a bug;
- exactly one ledger record per request, none with a negative count or cost;
- afterwards nothing held: no lease, no request in flight on the endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from bench.chaos import schema_fuzz
from bench.chaos.common import (
    ADMIN,
    KEY,
    MODEL,
    examples_block,
    fuzz_settings,
    held,
    ledger_tally,
    policies,
    unexpected_errors,
    until,
)
from bench.chaos.fuzz import json_values
from bench.chaos.surfaces import request
from gateway.ledger.reader import iter_entries
from gateway.transport.engine import UNBOUNDED_OUTPUT
from tests.support.procs import free_port, running, start_gateway, static_pool

COUNTS = st.sampled_from((-5, 0, 3, 10**12, "7", "x", None, 1.5, [1], {"a": 1}))
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
_MESSAGES = [{"role": "user", "content": "hi"}]
BODIES: dict[str, dict[str, Any]] = {  # a valid request of each API the stand-in's pool serves
    "/v1/chat/completions": {"model": MODEL, "messages": _MESSAGES, "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": MODEL, "messages": _MESSAGES, "max_tokens": 4},
}


@dataclass
class Answer:
    """What the stand-in engine answers the next chat request."""

    status: int = 200
    content_type: str = "application/json"
    chunks: list[bytes] = field(default_factory=list)
    drop: bool = False  # close the connection after the chunks, mid-answer


class HostileEngine:
    """A vLLM-looking endpoint (health, metrics, models, tokenize) whose chat answers a test sets."""

    def __init__(self) -> None:
        self.port = free_port()
        self.answer = Answer()
        self.served = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, name="hostile-engine", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HostileEngine:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        models = {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 8192}]}
        for path, answer in (("/health", b""), ("/metrics", b""), ("/v1/models", orjson.dumps(models))):
            app.router.add_get(path, _fixed(answer))
        app.router.add_post("/tokenize", _fixed(orjson.dumps({"count": 5, "max_model_len": 8192})))
        app.router.add_post("/{tail:.*}", self._chat)  # every API's path, the hosted providers' too
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        answer = self.answer
        self.served += 1
        response = web.StreamResponse(status=answer.status, headers={"Content-Type": answer.content_type})
        with contextlib.suppress(ConnectionError):  # the gateway may give up on an answer mid-way
            await response.prepare(request)
            for chunk in answer.chunks:
                await response.write(chunk)
            if answer.drop and request.transport is not None:
                request.transport.abort()
                return response
            await response.write_eof()
        return response


def _fixed(body: bytes) -> Any:
    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json" if body else "text/plain")

    return answer


def _usage(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 5)) == 0:
        return draw(json_values)
    usage: dict[str, Any] = {"prompt_tokens": draw(COUNTS), "completion_tokens": draw(COUNTS)}
    if draw(st.booleans()):
        usage["prompt_tokens_details"] = draw(st.sampled_from(({"cached_tokens": draw(COUNTS)}, None, 3)))
    return usage


def _unary(draw: st.DrawFn) -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": _usage(draw),
    }
    for _ in range(draw(st.integers(0, 2))):
        body[draw(st.sampled_from(("model", "choices", "id", "object", "usage")))] = draw(json_values)
    return json.dumps(body).encode()


def _events(draw: st.DrawFn) -> bytes:
    events: list[bytes] = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 6))
        if kind <= 1:
            chunk = {"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                     "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}  # fmt: skip
            events.append(b"data: " + orjson.dumps(chunk))
        elif kind == 2:
            events.append(b"data: " + json.dumps({"id": "c", "choices": [], "usage": _usage(draw)}).encode())
        elif kind == 3:
            events.append(b"data: " + json.dumps(draw(json_values)).encode())
        elif kind == 4:
            events.append(draw(st.sampled_from((b"data: {not json", b": comment", b"event: x", b"data:", b"\xff\xfe"))))
        elif kind == 5:
            events.append(draw(st.binary(max_size=60)))
        else:
            events.append(draw(st.sampled_from(_OTHER_APIS))(draw))
    if draw(st.integers(0, 3)) > 0:
        events.append(b"data: [DONE]")
    return b"".join(event + b"\n\n" for event in events)


def _anthropic_event(draw: st.DrawFn) -> bytes:
    """An event of Anthropic's Messages stream, usage of any shape where it carries one."""
    usage = {"input_tokens": draw(COUNTS), "output_tokens": draw(COUNTS)}
    message = {"id": "m", "type": "message", "role": "assistant", "model": MODEL, "content": [], "usage": usage}
    event = draw(
        st.sampled_from(
            (
                ("message_start", {"type": "message_start", "message": message}),
                ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}),
                ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"text": "x"}}),
                ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage}),
                ("message_stop", {"type": "message_stop"}),
                ("message_delta", {"type": "message_delta", "delta": None, "usage": None}),
            )
        )
    )
    return b"event: " + event[0].encode() + b"\ndata: " + json.dumps(event[1]).encode()


def _responses_event(draw: st.DrawFn) -> bytes:
    """An event of the Responses API's stream, usage of any shape where it carries one."""
    usage = {"input_tokens": draw(COUNTS), "output_tokens": draw(COUNTS)}
    event: dict[str, Any] = draw(
        st.sampled_from(
            (
                {"type": "response.created", "response": {"id": "r", "status": "in_progress"}},
                {"type": "response.output_text.delta", "delta": "x", "item_id": "i", "output_index": 0},
                {"type": "response.completed", "response": {"id": "r", "status": "completed", "usage": usage}},
                {"type": "response.completed", "response": None},
            )
        )
    )
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + json.dumps(event).encode()


_OTHER_APIS = (_anthropic_event, _responses_event)


def _provider_answer(draw: st.DrawFn) -> bytes:
    """A hosted provider's own non-streamed answer (Anthropic Messages, Gemini, Bedrock Converse),
    counts of any value and, sometimes, a field swapped for any JSON value."""
    text = {"type": "text", "text": "hi"}
    answer: dict[str, Any] = draw(
        st.sampled_from(
            (
                {"type": "message", "role": "assistant", "content": [text], "stop_reason": "end_turn",
                 "usage": {"input_tokens": draw(COUNTS), "output_tokens": draw(COUNTS),
                           "cache_read_input_tokens": draw(COUNTS)}},
                {"candidates": [{"content": {"parts": [{"text": "hi"}], "role": "model"}, "finishReason": "STOP"}],
                 "usageMetadata": {"promptTokenCount": draw(COUNTS), "candidatesTokenCount": draw(COUNTS),
                                   "thoughtsTokenCount": draw(COUNTS)}},
                {"output": {"message": {"role": "assistant", "content": [{"text": "hi"}]}}, "stopReason": "end_turn",
                 "usage": {"inputTokens": draw(COUNTS), "outputTokens": draw(COUNTS),
                           "cacheReadInputTokens": draw(COUNTS)}},
            )
        )
    )  # fmt: skip
    if draw(st.booleans()):
        answer[draw(st.sampled_from(sorted(answer)))] = draw(json_values)
    return json.dumps(answer).encode()


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    kind = draw(st.integers(0, 4))
    data = _unary(draw) if kind == 0 else _events(draw) if kind == 1 else draw(st.binary(max_size=300))
    if kind == 3:
        data = _unary(draw)[: draw(st.integers(0, 200))]  # a unary answer cut short
    elif kind == 4:
        data = _provider_answer(draw)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True) if data[a:b]]
    status = draw(st.sampled_from((200, 200, 200, 200, 400, 404, 500, 503, 204)))  # a 429 pauses the endpoint
    content_type = draw(
        st.sampled_from(("application/json", "text/event-stream", "text/plain", "application/octet-stream"))
    )
    return Answer(status, content_type, chunks, drop=draw(st.integers(0, 5)) == 0)


# vLLM answers every API natively; TensorRT-LLM's answers are translated from chat; the hosted
# providers' answers go through their codecs (backends/hosted/), keyed from this process's environment
ENGINES = ("vllm", "trtllm", "anthropic", "azure-openai", "gemini", "bedrock")
_HOSTED: dict[str, dict[str, Any]] = {
    "anthropic": {"api_key_env": "TOKENWAY_FUZZ_KEY"},
    "azure-openai": {"api_key_env": "TOKENWAY_FUZZ_KEY", "api_version": "2024-10-21"},
    "gemini": {"api_key_env": "TOKENWAY_FUZZ_KEY"},
    "bedrock": {"region": "us-east-1"},
}
_FUZZ_ENV = {  # fake credentials: the stand-in checks none, and nothing leaves this host
    "TOKENWAY_FUZZ_KEY": "fuzz-key",
    "AWS_ACCESS_KEY_ID": "AKIDFUZZ",
    "AWS_SECRET_ACCESS_KEY": "fuzz-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def started(workdir: Path, engine_kind: str = "vllm") -> Iterator[tuple[Any, HostileEngine]]:
    """The stand-in engine and a gateway whose one pool is it, as an engine of `engine_kind` (a key
    limited in tokens, so each request is reserved and settled)."""
    workdir.mkdir(parents=True, exist_ok=True)
    extra = {"served_model_name": "hostile-model", **_HOSTED[engine_kind]} if engine_kind in _HOSTED else {}
    with HostileEngine() as engine:
        with _fuzz_env():
            gateway = start_gateway(
                workdir / "gw",
                pools=[static_pool("hostile", MODEL, [engine.url], engine=engine_kind, **extra)],
                # Gemini's usage is billed as it reports it (docs/security.md), so one answer claiming
                # 10^12 tokens would spend a smaller limit and refuse the rest of the run
                policies=policies(
                    [{"scope": "key", "tpm": 10**15 if engine_kind in UNBOUNDED_OUTPUT else 100_000_000}]
                ),
                server={"admin_token": ADMIN},
                ledger={"dir": str(workdir / "usage"), "commit_interval_ms": 20},
                backends={"health_interval_s": 0.2},
                predictor={"enabled": False},
            )
        with running(gateway):
            yield gateway, engine


@contextlib.contextmanager
def _fuzz_env() -> Iterator[None]:
    """`_FUZZ_ENV` in this process's environment while the gateway starts (it inherits it), and the
    environment as it was afterwards (a test process goes on to run other tests)."""
    saved = {name: os.environ.get(name) for name in _FUZZ_ENV}
    os.environ.update(_FUZZ_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def send_one(gateway: Any, engine: HostileEngine, answer: Answer, workdir: Path) -> dict[str, Any]:
    """One chat request (not streamed, `max_tokens: 4`) answered with `answer`: its ledger record."""
    engine.answer = answer
    request_id = "upstream-one-" + uuid.uuid4().hex[:16]
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "x-request-id": request_id}
    request(gateway.port, "POST", PATHS[0], headers, orjson.dumps(BODIES[PATHS[0]]), timeout_s=60)
    found: list[dict[str, Any]] = []

    def recorded() -> bool:
        ledger = workdir / "usage"
        found[:] = [r for r in iter_entries(ledger) if r["request_id"] == request_id] if ledger.exists() else []
        return bool(found)

    until(recorded, timeout_s=20, interval_s=0.05)
    if not found:
        raise AssertionError(f"no ledger record for {request_id}")
    return found[0]


def fuzz(gateway: Any, engine: HostileEngine, workdir: Path, *, examples: int, seed: int | None) -> dict[str, Any]:
    statuses: dict[int, int] = {}
    failures: list[str] = []
    sent: list[str] = []
    samples: dict[int, str] = {}  # an answer of each status, for the reader
    started_s = time.monotonic()

    @fuzz_settings(examples, seed)
    @given(answers(), st.sampled_from(PATHS), st.booleans())
    def probe(answer: Answer, path: str, stream: bool) -> None:
        engine.answer = answer
        request_id = "upstream-fuzz-" + uuid.uuid4().hex[:16]
        sent.append(request_id)
        body = {**BODIES[path], "stream": stream}
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "x-request-id": request_id}
        status, _, raw = request(gateway.port, "POST", path, headers, orjson.dumps(body), timeout_s=60)
        statuses[status] = statuses.get(status, 0) + 1
        samples.setdefault(status, raw[:300].decode("utf-8", "replace"))
        if status == 0:
            failures.append(f"no answer to {path} (stream {stream}): engine {answer!r}"[:500])

    probe()
    seconds = time.monotonic() - started_s
    settled = until(lambda: held(gateway.url, {"Authorization": f"Bearer {ADMIN}"}) == (0, 0), timeout_s=30)
    leases, inflight = held(gateway.url, {"Authorization": f"Bearer {ADMIN}"})
    counts, negative = ledger_tally(workdir / "usage", "upstream-fuzz-")
    return {
        "examples": len(sent),
        "seed": seed,
        "statuses": dict(sorted(statuses.items())),
        "samples": samples,
        "served_by_engine": engine.served,
        "failures": len(failures),
        "failure_examples": failures[:5],
        "unrecorded": sum(1 for r in sent if r not in counts),
        "recorded_twice": sum(1 for n in counts.values() if n > 1),
        "negative_records": negative,
        "leases_left": leases,
        "inflight_left": inflight,
        "settled": settled,
        "unexpected_in_log": unexpected_errors(gateway.log()),
        "seconds": round(seconds, 1),
    }


def run(workdir: Path, *, examples: int = 1500, seed: int | None = None) -> dict[str, Any]:
    """Half the examples against each engine kind of `ENGINES`; the results added up."""
    results = []
    for kind in ENGINES:
        with started(workdir / kind, kind) as (gateway, engine):
            results.append(fuzz(gateway, engine, workdir / kind, examples=examples // len(ENGINES), seed=seed))
    return merge(results)


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The results of several runs as one: counts added, examples of failures joined."""
    out: dict[str, Any] = {"seed": results[0]["seed"], "statuses": {}, "samples": {}, "failure_examples": []}
    for r in results:
        for key, value in r.items():
            if key in ("seed", "settled"):
                continue
            if key == "statuses":
                for status, n in value.items():
                    out["statuses"][status] = out["statuses"].get(status, 0) + n
            elif key in ("samples",):
                out["samples"] = {**value, **out["samples"]}
            elif key == "failure_examples":
                out["failure_examples"] = (out["failure_examples"] + value)[:5]
            else:
                out[key] = out.get(key, 0) + value
    out["statuses"] = dict(sorted(out["statuses"].items()))
    out["settled"] = all(r["settled"] for r in results)
    return out


def met(r: dict[str, Any]) -> bool:
    return bool(
        r["failures"] == 0
        and r["unexpected_in_log"] == 0
        and r["unrecorded"] == 0
        and r["recorded_twice"] == 0
        and r["negative_records"] == 0
        and r["leases_left"] == 0
        and r["inflight_left"] == 0
    )


def section(r: dict[str, Any]) -> list[str]:
    statuses = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
    seeded = schema_fuzz.seeded(r)
    lines = [
        "## An engine that answers anything (hypothesis)",
        "",
        f"{r['examples']} requests{seeded} (chat, completions, Responses and Messages, streamed or not) in "
        f"{r['seconds']:g} s to a stand-in engine, in turn as a pool of each of {', '.join(ENGINES)} (vLLM "
        "answers every API natively, TensorRT-LLM's answers are translated from chat, the hosted providers' "
        "read by their codecs), answering each with a drawn "
        "answer (any status and content type, completions with fields swapped for any JSON value, usage counts "
        "from -5 to 10^12 or not numbers, event streams mixing valid chunks and garbage, cut at any byte, the "
        f"connection sometimes dropped). Answers to the clients by status: {statuses}.",
        "",
        "| unanswered | unexpected errors in the log | not recorded | recorded twice | records with negative "
        "tokens or cost | leases left | in flight left |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {r['failures']} | {r['unexpected_in_log']} | {r['unrecorded']} | {r['recorded_twice']} | "
        f"{r['negative_records']} | {r['leases_left']} | {r['inflight_left']} |",
        "",
        "Targets (every request answered and recorded exactly once, none negative, nothing held afterwards): "
        f"{'met' if met(r) else '**missed**'}.",
        "",
    ]
    return lines + examples_block(r["failure_examples"])

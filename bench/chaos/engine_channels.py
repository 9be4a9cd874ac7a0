"""Probe: what an engine reports on its side channels is input too (hypothesis-drawn reports).

`upstream_fuzz` drew what an engine *answers*. The gateway also reads, from every engine it fronts,
its KV-cache events over ZMQ (the precise prefix index follows them), its Prometheus `/metrics`
(routing, flow control, the autoscaler and the predictor read the load in it), its `/v1/models`
listing (the LoRA adapters it holds) and, in precise mode, its `/tokenize` answers. Here the one
endpoint of a vLLM pool is a stand-in engine that answers chat requests correctly, while everything
else it reports is drawn per example:

- KV events on its PUB socket: valid batches (both vLLM shapes) mixed with batches whose fields
  hold any msgpack value, payloads that are not msgpack, messages of 1, 4 or 50 frames, sequence
  numbers that jump, go back, are negative or 2^63-1, batches of 20,000 hashes, frames past the
  subscriber's size bound; its ROUTER replay socket answering honestly, with garbage, with old
  batches past the replay bound, or not at all;
- `/metrics`: vLLM's metric names with values NaN, +-Inf, negative, 1e300, label sets of thousands
  of reasons or adapter names, garbage lines, bytes that are not UTF-8, megabytes of lines;
- `/v1/models`: any JSON, entries of every shape, 8,192 adapters, ids of 10,000 characters, nesting
  past the parser's depth, a body past the bound;
- `/tokenize`: ids of the wrong type or range, now and then.

Clients meanwhile send ordinary chat requests (streamed or not) with a request id each.

Targets:
- every request answered with a non-5xx status, and the log shows no bug (the suite's
  `UNEXPECTED_IN_LOG`, plus a traceback, a subscriber's "failed handling a message", an unretrieved
  task exception);
- exactly one ledger record per request, none negative; afterwards nothing held;
- the endpoint's stats as `/admin/backends` shows them, read during the run, always finite and in
  range (no NaN, no negative count, a KV usage in 0..1);
- afterwards the KV subscriber still runs and applies a valid batch sent after all the garbage
  (`kv_events.last_seq` is its seq, the precise index holds its blocks), the scraper applies valid
  metrics (their running and waiting counts shown) and the LoRA discovery a valid listing;
- the gateway's RSS grows by less than `RSS_BOUND_MIB` over the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import orjson
import zmq
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from backends import kv_events, scrape
from bench.chaos import schema_fuzz
from bench.chaos.common import (
    ADMIN,
    KEY,
    MODEL,
    UNEXPECTED_IN_LOG,
    examples_block,
    fuzz_settings,
    held,
    ledger_tally,
    policies,
    until,
)
from bench.chaos.fuzz import json_values
from bench.chaos.surfaces import request
from tests.support.procs import Gateway, free_port, http_get, running, start_gateway

ADAPTER = "chaos-lora"  # declared, so the gateway asks the engine's /v1/models for its adapters
PREFIX = "engine-channels-"
RSS_BOUND_MIB = 96  # growth over a run: 29 MiB measured at 300 examples, 33-49 MiB at 2,000 (seeds: none, 1, 2)
# What else means a bug in this probe's log: a subscriber's catch-all, a traceback of any kind, a
# consumer of KV events that raised, a scrape task that died.
BUG_IN_LOG = (
    *UNEXPECTED_IN_LOG,
    "Traceback",
    "consumer failed",
    "failed handling a message",
    "Task exception was never retrieved",
)
BLOCK = 16
TOPIC = b"kv-events"  # the pool's `kv_events.topic` (default): the subscriber's filter
TOKENS = list(range(1000, 1000 + 4 * BLOCK))  # what the stand-in's /tokenize answers: 4 full blocks

VALID_METRICS = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"
FINAL_METRICS = b"vllm:num_requests_running 3\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.25\n"
VALID_MODELS = orjson.dumps(
    {
        "object": "list",
        "data": [
            {"id": MODEL, "object": "model", "parent": None, "max_model_len": 8192},
            {"id": ADAPTER, "object": "model", "parent": MODEL},
        ],
    }
)
VALID_TOKENIZE = orjson.dumps({"count": len(TOKENS), "max_model_len": 8192, "tokens": TOKENS})

# Reports too big to draw byte by byte: drawn whole.
_LINE = b"vllm:num_requests_running 1\n"
BIG_METRICS = (
    _LINE * (scrape.MAX_METRICS_BYTES // len(_LINE) + 1),  # past the bound
    b"vllm:num_requests_running 2\n"
    + b"".join(b'vllm:num_requests_waiting_by_reason{reason="r%d"} 7\n' % i for i in range(20_000)),
    b'vllm:num_requests_running 1\nvllm:lora_requests_info{max_lora="1e999",running_lora_adapters="'
    + b",".join(b"a%d" % i for i in range(50_000))
    + b'",waiting_lora_adapters="' + b"x" * 100_000 + b'"} 5\n',
)  # fmt: skip
BIG_MODELS = (
    orjson.dumps({"data": [{"id": f"a{i}", "parent": MODEL} for i in range(2 * scrape.MAX_LISTED)]}),
    orjson.dumps({"data": [{"id": "x" * 10_000, "parent": MODEL}, {"id": ADAPTER, "parent": MODEL}]}),
    b"[" * 5000,
    b'{"data": [' + b'{"id": "a", "parent": "m"},' * (scrape.MAX_LISTING_BYTES // 26 + 1) + b"null]}",
)


def _batch(seq: int, events: list[Any], ts: Any = None) -> list[bytes]:
    """A published message (`ts` None: now, as vLLM stamps its batches); seq -1 stands for the
    engine's next one (`NEXT`)."""
    ts = time.time() if ts is None else ts
    frame = NEXT if seq == -1 else seq.to_bytes(8, "big", signed=True)
    return [TOPIC, frame, msgpack.packb([ts, events, 0], use_bin_type=True)]


def _stored(first: int, count: int, *, array_shape: bool = False) -> Any:
    hashes = [0xC0FFEE + i for i in range(first, first + count)]
    parent = 0xC0FFEE + first - 1 if first else None
    tokens = [1000 + i for i in range(first * BLOCK, (first + count) * BLOCK)]
    if array_shape:
        return ["BlockStored", hashes, parent, tokens, BLOCK, None, "GPU"]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "medium": "GPU", "lora_name": None}  # fmt: skip


HUGE_BATCH = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": list(range(20_000))}], 0])
OVERSIZED = b"\x00" * (kv_events.MAX_MESSAGE_BYTES + 1)


class ChannelEngine:
    """A vLLM-looking endpoint: chat answered correctly, and /metrics, /v1/models, /tokenize, the KV
    events it publishes and its replay socket's answers set by the probe."""

    def __init__(self) -> None:
        self.port, self.pub_port, self.replay_port = free_port(), free_port(), free_port()
        self.metrics = VALID_METRICS
        self.models = VALID_MODELS
        self.tokenize = VALID_TOKENIZE
        self.replay_mode = "honest"  # honest | garbage | forever | silent
        self.replay_buffer: dict[int, list[bytes]] = {}
        self.seq = -1  # the last seq of a valid batch published
        self.served = 0
        self._zmq = zmq.Context()
        self._pub = self._zmq.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._http = threading.Thread(target=self._run_http, name="channel-engine", daemon=True)
        self._replay = threading.Thread(target=self._run_replay, name="channel-engine-replay", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ChannelEngine:
        self._http.start()
        self._replay.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._http.join(10)
        self._replay.join(10)
        self._pub.close(0)
        self._zmq.term()

    # -- KV events ----------------------------------------------------------------------------

    def publish(self, frames: list[bytes]) -> None:
        """One message on the PUB socket (only the probe's thread publishes)."""
        self._pub.send_multipart(frames)

    def publish_valid(self, events: list[Any]) -> int:
        """A valid batch with the next seq, kept for the replay socket; its seq."""
        self.seq += 1
        frames = _batch(self.seq, events)
        self.replay_buffer[self.seq] = frames
        self.replay_buffer.pop(self.seq - 200, None)
        self.publish(frames)
        return self.seq

    def _run_replay(self) -> None:
        """vLLM's replay server ([id, "", start] -> [id, "", topic, seq, payload]... then seq -1), or
        what `replay_mode` says instead."""
        sock = self._zmq.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{self.replay_port}")
        end = [b"", (-1).to_bytes(8, "big", signed=True), b""]
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                request_frames = sock.recv_multipart()
                identity, start = request_frames[0], request_frames[-1]
                first = int.from_bytes(start, "big", signed=True) if len(start) == 8 else 0
                mode = self.replay_mode
                if mode == "silent":
                    continue
                if mode == "garbage":
                    for frames in ([TOPIC, b"\x01", b"?"], [b"x"] * 7, [TOPIC, b"\x00" * 8, b"\xc1\xc1"]):
                        sock.send_multipart([identity, b"", *frames])
                elif mode == "forever":  # an old batch past the replay bound (ROUTER drops beyond its HWM)
                    old = _batch(0, [_stored(0, 1)])
                    for _ in range(kv_events.MAX_REPLAY_BATCHES + 10):
                        sock.send_multipart([identity, b"", *old], zmq.NOBLOCK)
                else:
                    buffered = dict(self.replay_buffer)  # a snapshot: the publisher trims the buffer meanwhile
                    for seq in sorted(buffered):
                        if seq >= first:
                            sock.send_multipart([identity, b"", *buffered[seq]])
                sock.send_multipart([identity, b"", *end])
        finally:
            sock.close(0)

    # -- HTTP ---------------------------------------------------------------------------------

    def _run_http(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=1 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _answer(self, body: bytes, content_type: str = "application/json") -> web.Response:
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _health(self, _: web.Request) -> web.Response:
        return await self._answer(b"")

    async def _metrics(self, _: web.Request) -> web.Response:
        return await self._answer(self.metrics, "text/plain")

    async def _models(self, _: web.Request) -> web.Response:
        return await self._answer(self.models)

    async def _tokenize(self, request: web.Request) -> web.Response:
        await request.read()
        return await self._answer(self.tokenize)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.served += 1
        usage = {"prompt_tokens": len(TOKENS), "completion_tokens": 2, "total_tokens": len(TOKENS) + 2}
        if not body.get("stream"):
            answer = {"id": "chatcmpl-c", "object": "chat.completion", "model": body.get("model"),
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                   "finish_reason": "stop"}], "usage": usage}  # fmt: skip
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": body.get("model"),
                 "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]}  # fmt: skip
        done = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        for event in (chunk, done, {**chunk, "choices": [], "usage": usage}):
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


# --- what the engine reports, drawn ------------------------------------------------------------------

MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=10,
)  # fmt: skip
_FIELDS = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_name",
           "extra_keys")  # fmt: skip


NEXT = b"NEXT"  # a seq frame the probe replaces with the engine's next seq when it publishes


def _kv_message(draw: st.DrawFn) -> tuple[str, list[Any]]:
    """("valid", events) to publish with the engine's next seq, or ("raw", frames) published as is
    (a seq frame `NEXT` replaced by the engine's next seq; a seq given relative to it as ("jump", [delta, events]))."""
    kind = draw(st.integers(0, 11))
    events: list[Any] = [_stored(draw(st.integers(0, 3)), draw(st.integers(1, 4)), array_shape=draw(st.booleans()))]
    if kind <= 3:
        extra = draw(st.sampled_from((["AllBlocksCleared"], {"type": "BlockRemoved", "block_hashes": [0xC0FFEE]},
                                      {"type": "SomethingNew"})))  # fmt: skip
        return "valid", [*events, extra] if draw(st.booleans()) else events
    seq = -1  # replaced by NEXT below
    if kind == 4:  # a valid batch with any seq: a jump, a step back, 0, the end of the range, negative
        return "jump", [draw(st.sampled_from((5, -3, -(1 << 70), 1 << 70, 1 << 62))), events]
    if kind == 5:  # fields of any value
        event = dict(_stored(0, 2))
        for name in draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3)):
            event[name] = draw(MSGPACK_VALUES)
        ts = draw(st.sampled_from((None, None, "now", {"a": 1}, math.nan, math.inf, 1e18, -5.0)))
        return "raw", _batch(seq, [event], ts)
    if kind == 6:  # a payload of any msgpack value, or bytes
        payload = msgpack.packb(draw(MSGPACK_VALUES)) if draw(st.booleans()) else draw(st.binary(max_size=60))
        return "raw", [TOPIC, NEXT, payload]
    if kind == 7:  # frames of the wrong count or size
        good = _batch(seq, events)
        return "raw", draw(st.sampled_from(([good[2]], [*good, b"x"], [*good, *[b"y"] * 47], [TOPIC, b"\x00" * 3,
                                                                                            good[2]])))  # fmt: skip
    if kind == 8:
        return "raw", [TOPIC, NEXT, HUGE_BATCH]
    if kind == 9:
        return "raw", [TOPIC, NEXT, OVERSIZED]
    return "raw", _batch(seq, [draw(MSGPACK_VALUES)])  # kind 10, 11: an event that is any value


_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total",
          "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total")  # fmt: skip
_VALUES = ("1", "0", "3", "0.5", "-5", "NaN", "+Inf", "-Inf", "1e300", "-1e300", "9e15", "1e308", "abc", "")


def _metrics(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 19))
    if kind == 0:
        return draw(st.sampled_from(BIG_METRICS))
    if kind == 1:
        return draw(st.binary(max_size=200))
    lines: list[str] = []
    for _ in range(draw(st.integers(0, 8))):
        shape = draw(st.integers(0, 6))
        value = draw(st.sampled_from(_VALUES))
        if shape <= 2:
            lines.append(f"{draw(st.sampled_from(_NAMES))} {value}")
        elif shape == 3:
            labels = {
                "block_size": draw(st.sampled_from(("16", "-1", "0", "1e999", "x", "65537", "nan"))),
                "num_gpu_blocks": draw(st.sampled_from(("100", "-4", "1e300", "inf", ""))),
            }
            lines.append("vllm:cache_config_info{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "} 1")
        elif shape == 4:
            reason = draw(st.text(max_size=20)).replace('"', "").replace("\\", "").replace("\n", "")
            lines.append(f'vllm:num_requests_waiting_by_reason{{reason="{reason}"}} {value}')
        elif shape == 5:
            state = draw(st.sampled_from(("awake", "asleep", "x" * 500, "")))
            lines.append(f'vllm:engine_sleep_state{{sleep_state="{state}"}} {value}')
        else:
            lines.append(draw(st.text(max_size=60)).replace("\n", " "))
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


def _models(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.sampled_from(BIG_MODELS))
    if kind <= 2:
        return json.dumps(draw(json_values)).encode()  # json: ints past 64 bits too
    if kind == 3:
        return draw(st.binary(max_size=100))
    entries = draw(st.lists(st.one_of(json_values, st.fixed_dictionaries(
        {"id": st.one_of(st.sampled_from((ADAPTER, MODEL, "x")), json_values),
         "parent": st.one_of(st.sampled_from((MODEL, None, ADAPTER)), json_values)})), max_size=6))  # fmt: skip
    return json.dumps({"object": "list", "data": entries}).encode()


@st.composite
def reports(draw: st.DrawFn) -> dict[str, Any]:
    """What the engine reports until the next example: events, metrics, a listing, /tokenize, replay."""
    return {
        "kv": [_kv_message(draw) for _ in range(draw(st.integers(0, 5)))],
        "metrics": VALID_METRICS if draw(st.integers(0, 4)) == 0 else _metrics(draw),
        "models": VALID_MODELS if draw(st.integers(0, 4)) == 0 else _models(draw),
        "tokenize": draw(
            st.sampled_from(
                (VALID_TOKENIZE,) * 6
                + (
                    orjson.dumps({"tokens": ["a"]}),
                    orjson.dumps({"tokens": [-1, 2]}),
                    orjson.dumps({"tokens": [1 << 40]}),
                    orjson.dumps({"tokens": "x"}),
                    b"[",
                    orjson.dumps(None),
                )
            )
        ),
        "replay": draw(st.sampled_from(("honest",) * 6 + ("garbage", "garbage", "silent", "forever"))),
    }


# --- the probe ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def started(workdir: Path) -> Iterator[tuple[Gateway, ChannelEngine]]:
    """The stand-in engine and a gateway whose one pool is it (precise prefix routing, so it follows
    the KV events; an adapter of its model declared, so it reads the listing)."""
    workdir.mkdir(parents=True, exist_ok=True)
    policy = policies([{"scope": "key", "tpm": 100_000_000}])
    policy["models"][ADAPTER] = {"kind": "adapter", "base": MODEL, "source": str(workdir / "adapter"), "size_mb": 1}
    # an engine that reports itself full (a drawn waiting count or KV usage may say so) holds requests
    # in the waiting room: answered 429 after a short wait, not 10 s
    policy["flow_control"] = {"bands": {"normal": {"max_queue_ms": 300, "on_timeout": 429}}}
    with ChannelEngine() as engine:
        endpoint = {
            "url": engine.url,
            "kv_events_endpoint": f"tcp://127.0.0.1:{engine.pub_port}",
            "kv_events_replay_endpoint": f"tcp://127.0.0.1:{engine.replay_port}",
        }
        gateway = start_gateway(
            workdir / "gw",
            pools=[{"name": "channels", "model": MODEL, "engine": "vllm", "endpoints": [endpoint]}],
            policies=policy,
            server={"admin_token": ADMIN},
            ledger={"dir": str(workdir / "usage"), "commit_interval_ms": 20},
            backends={"health_interval_s": 0.2, "lora_discovery_interval_s": 0.2, "scrape_interval_s": 0.1},
            routing={"prefix_index": {"mode": "precise"}},
            predictor={"enabled": False},
        )
        with running(gateway):
            yield gateway, engine


def endpoint_status(gateway: Gateway) -> dict[str, Any]:
    status, body = http_get(gateway.url + "/admin/backends", {"Authorization": f"Bearer {ADMIN}"}, timeout_s=10)
    if status != 200:
        return {}
    endpoint: dict[str, Any] = orjson.loads(body)["pools"][0]["endpoints"][0]
    return endpoint


def stats_in_range(endpoint: dict[str, Any]) -> bool:
    """What routing reads of the endpoint's metrics, as the admin API shows it: finite, in range."""
    running_, waiting = endpoint.get("running"), endpoint.get("waiting")
    kv = endpoint.get("kv_usage_ratio")
    counters = (endpoint.get("prefix_cache_hits_tokens"), endpoint.get("prefix_cache_queries_tokens"),
                endpoint.get("preemptions"), endpoint.get("prompt_tokens"))  # fmt: skip
    return bool(
        isinstance(running_, int) and 0 <= running_ <= scrape.MAX_ENGINE_REQUESTS
        and isinstance(waiting, int) and 0 <= waiting <= scrape.MAX_ENGINE_REQUESTS
        and isinstance(kv, int | float) and 0.0 <= kv <= 1.0
        and all(isinstance(c, int | float) and 0 <= c <= scrape.MAX_COUNTER for c in counters)
        and len(endpoint.get("waiting_by_reason") or {}) <= scrape.MAX_LABEL_KEYS
        and (endpoint.get("block_size") is None or 1 <= endpoint["block_size"] <= scrape.MAX_BLOCK_SIZE)
        and len(endpoint.get("loras") or ()) <= scrape.MAX_LISTED
    )  # fmt: skip


def rss_mib(gateway: Gateway) -> float:
    for line in Path(f"/proc/{gateway.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def chat(gateway: Gateway, stream: bool, prefix: str = PREFIX) -> tuple[str, int]:
    request_id = prefix + uuid.uuid4().hex[:16]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "x-request-id": request_id}
    status, _, _ = request(gateway.port, "POST", "/v1/chat/completions", headers, orjson.dumps(body), timeout_s=60)
    return request_id, status


def fuzz(gateway: Gateway, engine: ChannelEngine, workdir: Path, *, examples: int, seed: int | None) -> dict[str, Any]:
    statuses: dict[int, int] = {}
    sent: list[str] = []
    failures: list[str] = []
    drawn = {"kv_messages": 0, "kv_valid": 0}
    out_of_range: list[dict[str, Any]] = []
    # warm-up: subscribed, scraped, a few requests, so the RSS measured is the steady state's
    until(lambda: (endpoint_status(gateway).get("kv_events") or {}).get("running") is True, timeout_s=30)
    for _ in range(20):
        engine.publish_valid([_stored(0, 4)])
        chat(gateway, stream=False, prefix="warm-up-")
    rss_before = rss_mib(gateway)
    started_s = time.monotonic()

    @fuzz_settings(examples, seed)
    @given(reports(), st.booleans())
    def probe(report: dict[str, Any], stream: bool) -> None:
        engine.metrics, engine.models, engine.tokenize = report["metrics"], report["models"], report["tokenize"]
        engine.replay_mode = report["replay"]
        for what, payload in report["kv"]:
            drawn["kv_messages"] += 1
            if what == "valid":
                drawn["kv_valid"] += 1
                engine.publish_valid(payload)
            elif what == "jump":  # wrapped into the signed 64-bit range the frame holds
                seq = (engine.seq + payload[0] + (1 << 63)) % (1 << 64) - (1 << 63)
                engine.publish(_batch(seq, payload[1]) if seq != -1 else _batch(0, payload[1]))
            else:
                nxt = (engine.seq + 1).to_bytes(8, "big", signed=True)
                engine.publish([nxt if frame is NEXT else frame for frame in payload])
        request_id, status = chat(gateway, stream)
        sent.append(request_id)
        statuses[status] = statuses.get(status, 0) + 1
        if status == 0 or status >= 500:
            failures.append(f"{status} to a chat request (stream {stream}) with reports {report!r:.400}")
        if len(sent) % 25 == 0:
            endpoint = endpoint_status(gateway)
            if not stats_in_range(endpoint):
                out_of_range.append({k: endpoint.get(k) for k in ("running", "waiting", "kv_usage_ratio",
                                                                   "block_size", "waiting_by_reason")})  # fmt: skip

    probe()
    seconds = time.monotonic() - started_s
    return {
        "examples": len(sent),
        "seed": seed,
        "statuses": dict(sorted(statuses.items())),
        "failures": len(failures),
        "failure_examples": failures[:5],
        "stats_out_of_range": len(out_of_range),
        "out_of_range_examples": out_of_range[:3],
        "seconds": round(seconds, 1),
        "rss_before_mib": round(rss_before, 1),
        **drawn,
    }


def afterwards(gateway: Gateway, engine: ChannelEngine, workdir: Path) -> dict[str, Any]:
    """Valid reports again: each channel's reader must still be there and apply them."""
    engine.metrics, engine.models, engine.tokenize, engine.replay_mode = (
        FINAL_METRICS, VALID_MODELS, VALID_TOKENIZE, "honest")  # fmt: skip
    final = {"seq": -1}

    def applied() -> bool:
        final["seq"] = engine.publish_valid([["AllBlocksCleared"], _stored(0, 4)])  # again until one lands
        time.sleep(0.1)
        sub = endpoint_status(gateway).get("kv_events") or {}
        return bool(sub.get("running")) and sub.get("last_seq") == final["seq"]

    kv_applied = until(applied, timeout_s=30, interval_s=0.2)
    endpoint = endpoint_status(gateway)
    metrics_applied = until(
        lambda: (endpoint_status(gateway).get("running"), endpoint_status(gateway).get("waiting")) == (3, 2),
        timeout_s=20,
    )
    loras_applied = until(lambda: endpoint_status(gateway).get("loras") == [ADAPTER], timeout_s=20)
    settled = until(lambda: held(gateway.url, {"Authorization": f"Bearer {ADMIN}"}) == (0, 0), timeout_s=30)
    leases, inflight = held(gateway.url, {"Authorization": f"Bearer {ADMIN}"})
    counts, negative = ledger_tally(workdir / "usage", PREFIX)
    log = gateway.log()
    return {
        "kv_applied": kv_applied,
        "kv_subscription": endpoint.get("kv_events") or {},
        "precise_blocks": (endpoint.get("precise_index") or {}).get("blocks", 0),
        "metrics_applied": metrics_applied,
        "loras_applied": loras_applied,
        "settled": settled,
        "leases_left": leases,
        "inflight_left": inflight,
        "counts": counts,
        "negative_records": negative,
        "bugs_in_log": sum(log.count(marker) for marker in BUG_IN_LOG),
        "warnings_in_log": log.count("unusable metrics") + log.count("undecodable"),
        "rss_after_mib": round(rss_mib(gateway), 1),
    }


def run(root: Path, *, examples: int = 2000, seed: int | None = None) -> dict[str, Any]:
    """`examples` drawn reports (and as many chat requests) against one gateway, then the checks
    afterwards; the numbers `section` reports and `met` judges."""
    workdir = root / "engine_channels"
    with started(workdir) as (gateway, engine):
        result = fuzz(gateway, engine, workdir, examples=examples, seed=seed)
        after = afterwards(gateway, engine, workdir)
    counts = after.pop("counts")
    sent = result["examples"]
    result.update(after)
    result["unrecorded"] = sent - sum(1 for r, n in counts.items() if n >= 1)
    result["recorded_twice"] = sum(1 for n in counts.values() if n > 1)
    result["rss_growth_mib"] = round(result["rss_after_mib"] - result["rss_before_mib"], 1)
    return result


def met(r: dict[str, Any]) -> bool:
    return bool(
        r["failures"] == 0
        and r["bugs_in_log"] == 0
        and r["unrecorded"] == 0
        and r["recorded_twice"] == 0
        and r["negative_records"] == 0
        and r["leases_left"] == 0
        and r["inflight_left"] == 0
        and r["stats_out_of_range"] == 0
        and r["kv_applied"]
        and r["precise_blocks"] >= 4
        and r["metrics_applied"]
        and r["loras_applied"]
        and r["rss_growth_mib"] < RSS_BOUND_MIB
    )


def section(r: dict[str, Any]) -> list[str]:
    statuses = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
    sub = r["kv_subscription"]
    seeded = schema_fuzz.seeded(r)
    lines = [
        "## What an engine reports on its side channels (hypothesis)",
        "",
        f"{r['examples']} chat requests{seeded} in {r['seconds']:g} s through a gateway (precise prefix routing) "
        "whose one engine answers them correctly while everything else it reports is drawn: "
        f"{r['kv_messages']} KV-event messages ({r['kv_valid']} valid; the rest fields of any msgpack value, "
        "payloads that are not msgpack, 1 to 50 frames, sequence numbers that jump, go back or reach 2^63-1, "
        "20,000-hash batches, frames past the size bound), a replay socket answering honestly, garbage, old "
        "batches past its bound or nothing, `/metrics` with NaN, infinite, negative and 1e300 values, "
        "thousands of labels and megabytes of lines, `/v1/models` of any JSON shape and size, `/tokenize` "
        f"with ids that are not ids. Answers to the clients by status: {statuses}.",
        "",
        "| 5xx or unanswered | bugs in the log | not recorded | recorded twice | negative records | leases left "
        "| in flight left | stats out of range | RSS growth (MiB) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {r['failures']} | {r['bugs_in_log']} | {r['unrecorded']} | {r['recorded_twice']} | "
        f"{r['negative_records']} | {r['leases_left']} | {r['inflight_left']} | {r['stats_out_of_range']} | "
        f"{r['rss_growth_mib']:g} |",
        "",
        f"Afterwards: a valid batch applied {'yes' if r['kv_applied'] else '**no**'} (subscription running, "
        f"{sub.get('batches', 0)} batches, {sub.get('decode_errors', 0)} undecodable, {sub.get('gaps', 0)} gaps, "
        f"{sub.get('disconnects', 0)} disconnections; the index holds {r['precise_blocks']} blocks); valid "
        f"metrics applied {'yes' if r['metrics_applied'] else '**no**'}; a valid listing applied "
        f"{'yes' if r['loras_applied'] else '**no**'}; {r['warnings_in_log']} warnings in the log.",
        "",
        "Targets (every request answered without a 5xx and recorded exactly once, nothing held, no bug in the "
        "log, the stats always in range, every reader alive afterwards, RSS growth under "
        f"{RSS_BOUND_MIB} MiB): {'met' if met(r) else '**missed**'}.",
        "",
    ]
    out_of_range = [f"stats out of range: {example}" for example in r["out_of_range_examples"]]
    return lines + examples_block([*r["failure_examples"], *out_of_range])

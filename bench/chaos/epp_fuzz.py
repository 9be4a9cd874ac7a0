"""Probe: the endpoint picker's own surface (`tokenway epp`), fuzzed with hypothesis-drawn ext_proc streams.

The HTTP probes walk `/openapi.json`; the picker's input is Envoy's ExternalProcessor stream, which no
route of that document names, so it gets a fuzz of its own. Each example is one `Process` stream: a
sequence of ProcessingRequest messages in any order and any number (up to 10): request headers
(names and values the client chose, including bytes that are not UTF-8, any `:path`, the body modes a
data plane could announce, subset hints of every shape, `end_of_stream` either way), request body
chunks (a valid chat request, one with a field swapped for any JSON value, or arbitrary bytes),
trailers, response headers with any `:status`, response body chunks (server-sent events, JSON or
arbitrary bytes) and the served-endpoint metadata. The stream is read to its end.

Targets:
- no stream ends in an error status that means the picker failed (UNKNOWN, INTERNAL), and the log
  shows no request meeting a bug;
- no immediate response is a 5xx other than the protocol's 503 (no endpoint) and the 500 of a body
  mode that cannot carry a pick (the data plane's misconfiguration, `epp_misconfigured`);
- every request recorded at most once in the ledger (by the stream's `x-request-id`), every request
  picked recorded exactly once, and none with a negative token count or cost (the answers' usage is
  drawn from -5 to 10^12);
- afterwards nothing held: no lease active, no request in flight on an endpoint.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import orjson
from hypothesis import given
from hypothesis import strategies as st

from bench.chaos import schema_fuzz
from bench.chaos.checklist import HOSTILE_HEADERS
from bench.chaos.common import examples_block, fuzz_settings, held, ledger_tally, unexpected_errors, until
from bench.chaos.fuzz import json_values
from gateway.epp import protocol
from tests.support.envoy_side import Picker, running_picker
from tests.support.procs import TEST_KEY, policies_doc, start_sim, static_pool

MODEL = "llama-3.1-8b"
FAILED = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/", "/v1/chat/completions?x=1")
AUTHORIZATIONS = (f"Bearer {TEST_KEY}".encode(), b"Bearer wrong", b"\xea")
STATUSES = (b"200", b"200", b"500", b"abc", b"", b"99999999999999999999", b"\xff")
_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)  # protobuf strings are UTF-8


def _chat(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}


@st.composite
def _body(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    body = _chat(draw(st.booleans()))
    if kind == 1:
        body[draw(st.sampled_from(("model", "messages", "max_tokens", "stream", "n", "priority", "user")))] = draw(
            json_values
        )
    return json.dumps(body).encode()  # json_values holds integers beyond 64 bits


@st.composite
def _response_body(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 3))
    usage = {"prompt_tokens": draw(st.integers(-5, 10**12)), "completion_tokens": draw(st.integers(-5, 10**12))}
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        chunk = {"id": "c", "model": "engine-llama", "choices": [{"index": 0, "delta": {"content": "x"}}]}
        return b"data: " + orjson.dumps(chunk) + b"\n\ndata: " + orjson.dumps({"usage": usage}) + b"\n\n"
    if kind == 2:
        return b"data: [DONE]\n\n"
    return orjson.dumps({"model": "engine-llama", "choices": [], "usage": draw(st.sampled_from((usage, None, 7)))})


@st.composite
def _headers(draw: st.DrawFn, request_id: str, envoy: Any, valid: bool = False) -> Any:
    """A request-headers message: as Envoy sends a client's request (`valid`), or anything."""
    pairs: list[tuple[str, bytes]] = [
        (":method", b"POST" if valid else draw(st.sampled_from((b"POST", b"GET", b"\xff")))),
        (":path", PATHS[0].encode() if valid else draw(st.sampled_from(PATHS).map(str.encode) | _text.map(str.encode))),
        ("authorization", f"Bearer {TEST_KEY}".encode() if valid else draw(st.sampled_from(AUTHORIZATIONS))),
        ("content-type", b"application/json"),
        ("x-request-id", request_id.encode()),
    ]
    if not valid:
        hostile = draw(st.lists(st.sampled_from(HOSTILE_HEADERS[1:]), max_size=4))
        pairs += [(k.decode().lower(), v) for k, v in hostile]
        pairs += draw(st.lists(st.tuples(_text.map(str.lower), st.binary(max_size=40)), max_size=3))
    values = [envoy.base.HeaderValue(key=k, raw_value=v) for k, v in pairs]
    message = envoy.ext_proc.ProcessingRequest(
        request_headers=envoy.ext_proc.HttpHeaders(
            headers=envoy.base.HeaderMap(headers=values), end_of_stream=not valid and draw(st.integers(0, 4)) == 0
        )
    )
    if draw(st.integers(0, 3)) > 0:
        modes = (4,) if valid else (4, 4, 4, 2, 0, 1, 3)
        message.protocol_config.request_body_mode = draw(st.sampled_from(modes))
        message.protocol_config.response_body_mode = draw(st.sampled_from(modes))
    hint = draw(st.integers(0, 4))
    namespace = message.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE]
    if hint == 1:
        namespace.update(
            {protocol.SUBSET: draw(st.lists(st.sampled_from(("127.0.0.1:1", "x", "")) | _text, max_size=3))}
        )
    elif hint == 2 and not valid:
        namespace.update({protocol.SUBSET: draw(_text)})
    elif hint == 3 and not valid:
        namespace.update({protocol.SUBSET: 7.5})
    return message


@st.composite
def _message(draw: st.DrawFn, request_id: str, envoy: Any) -> Any:
    """Any one message of a stream."""
    e = envoy.ext_proc
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return draw(_headers(request_id, envoy))
    if kind in (1, 2):
        return e.ProcessingRequest(request_body=e.HttpBody(body=draw(_body()), end_of_stream=draw(st.booleans())))
    if kind == 3:
        which = draw(st.sampled_from(("request_trailers", "response_trailers")))
        return e.ProcessingRequest(**{which: e.HttpTrailers()})
    if kind == 4:
        return _response_headers(envoy, draw(st.sampled_from(STATUSES)), draw(st.integers(0, 4)) == 0)
    message = e.ProcessingRequest(
        response_body=e.HttpBody(body=draw(_response_body()), end_of_stream=draw(st.booleans()))
    )
    if draw(st.booleans()):
        served = draw(st.sampled_from(("127.0.0.1:1", "")) | _text)
        message.metadata_context.filter_metadata[protocol.LB_NAMESPACE].update({protocol.SERVED: served})
    return message


def _response_headers(envoy: Any, status: bytes, end_of_stream: bool) -> Any:
    headers = envoy.base.HeaderMap(headers=[envoy.base.HeaderValue(key=":status", raw_value=status)])
    return envoy.ext_proc.ProcessingRequest(
        response_headers=envoy.ext_proc.HttpHeaders(headers=headers, end_of_stream=end_of_stream)
    )


@st.composite
def streams(draw: st.DrawFn, envoy: Any) -> tuple[str, list[Any]]:
    """One `Process` stream: its request id and its messages. Half start from the exchange Envoy has
    with a picker for a client's chat request (headers, body, the response's headers, events, end)
    and then have messages inserted, dropped or repeated; half are any messages in any order."""
    e = envoy.ext_proc
    request_id = "epp-fuzz-" + uuid.uuid4().hex[:16]
    if draw(st.booleans()):
        stream = draw(st.booleans())
        messages = [
            draw(_headers(request_id, envoy, valid=True)),
            e.ProcessingRequest(request_body=e.HttpBody(body=orjson.dumps(_chat(stream)), end_of_stream=True)),
            _response_headers(envoy, b"200", False),
            e.ProcessingRequest(response_body=e.HttpBody(body=draw(_response_body()), end_of_stream=False)),
            e.ProcessingRequest(response_body=e.HttpBody(body=b"", end_of_stream=True)),
        ]
        for _ in range(draw(st.integers(0, 3))):
            at = draw(st.integers(0, len(messages)))
            change = draw(st.integers(0, 2))
            if change == 0:
                messages.insert(at, draw(_message(request_id, envoy)))
            elif change == 1 and at < len(messages):
                del messages[at]
            elif at < len(messages):
                messages.insert(at, messages[at])
        return request_id, messages
    messages = [draw(_headers(request_id, envoy))] if draw(st.integers(0, 9)) > 0 else []
    messages += draw(st.lists(_message(request_id, envoy), max_size=9))
    return request_id, messages


def _is_pick(response: Any) -> bool:
    return protocol.LB_NAMESPACE in response.dynamic_metadata.fields


def send(stub: Any, messages: list[Any]) -> tuple[grpc.StatusCode, list[Any]]:
    """One stream, read to its end: its final status and the responses the picker sent."""
    responses: list[Any] = []
    try:
        responses.extend(stub.Process(iter(messages), timeout=30))
    except grpc.RpcError as exc:
        return exc.code(), responses
    return grpc.StatusCode.OK, responses


def start(workdir: Path) -> Any:
    workdir.mkdir(parents=True, exist_ok=True)
    engines = start_sim(workdir, count=2, served_model_name="engine-llama")
    pool = static_pool("pool", MODEL, engines.urls, served_model_name="engine-llama")
    ledger = {"dir": str(workdir / "usage"), "commit_interval_ms": 20}
    return running_picker(workdir, engines, pools=[pool], policies=policies_doc(), ledger=ledger)


def fuzz(picker: Picker, workdir: Path, *, examples: int, seed: int | None = None) -> dict[str, Any]:
    envoy = protocol.envoy()
    channel = grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}")
    stub = envoy.ext_proc_grpc.ExternalProcessorStub(channel)
    codes: dict[str, int] = {}
    immediates: dict[int, int] = {}
    failures: list[str] = []
    picked: set[str] = set()
    started = time.monotonic()

    @fuzz_settings(examples, seed)
    @given(streams(envoy))
    def probe(stream: tuple[str, list[Any]]) -> None:
        request_id, messages = stream
        code, responses = send(stub, messages)
        codes[code.name] = codes.get(code.name, 0) + 1
        kinds = [r.WhichOneof("response") for r in responses]
        if code in FAILED:
            failures.append(f"{code.name}: {kinds} after {[m.WhichOneof('request') for m in messages]}")
        for response in responses:
            if response.WhichOneof("response") == "immediate_response":
                status = int(response.immediate_response.status.code)
                immediates[status] = immediates.get(status, 0) + 1
                details = response.immediate_response.details
                if status >= 500 and status != 503 and details != "epp_misconfigured":
                    failures.append(f"immediate {status} {details}: {response.immediate_response.body[:160]!r}")
            if _is_pick(response):
                picked.add(request_id)

    try:
        probe()
    finally:
        channel.close()
    seconds = time.monotonic() - started
    settled = until(lambda: held(picker.gateway.url) == (0, 0), timeout_s=30)
    leases, inflight = held(picker.gateway.url)
    counts, negative = ledger_tally(workdir / "usage", "epp-fuzz-")
    return {
        "examples": sum(codes.values()),
        "seed": seed,
        "codes": dict(sorted(codes.items())),
        "immediates": dict(sorted(immediates.items())),
        "failures": len(failures),
        "failure_examples": failures[:5],
        "picked": len(picked),
        "recorded": len(counts),
        "recorded_twice": sum(1 for n in counts.values() if n > 1),
        "picked_unrecorded": sum(1 for r in picked if r not in counts),
        "negative_records": negative,
        "leases_left": leases,
        "inflight_left": inflight,
        "settled": settled,
        "unexpected_in_log": unexpected_errors(picker.gateway.log()),
        "seconds": round(seconds, 1),
    }


def run(workdir: Path, *, examples: int = 1500, seed: int | None = None) -> dict[str, Any]:
    with start(workdir) as picker:
        return fuzz(picker, workdir, examples=examples, seed=seed)


def met(r: dict[str, Any]) -> bool:
    return bool(
        r["failures"] == 0
        and r["unexpected_in_log"] == 0
        and r["recorded_twice"] == 0
        and r["picked_unrecorded"] == 0
        and r["negative_records"] == 0
        and r["leases_left"] == 0
        and r["inflight_left"] == 0
    )


def section(r: dict[str, Any]) -> list[str]:
    codes = ", ".join(f"{k}: {v}" for k, v in r["codes"].items())
    immediates = ", ".join(f"{k}: {v}" for k, v in r["immediates"].items()) or "none"
    seeded = schema_fuzz.seeded(r)
    lines = [
        "## The endpoint picker's stream (`tokenway epp`, hypothesis)",
        "",
        f"{r['examples']} ext_proc streams{seeded} in {r['seconds']:g} s, each up to 10 messages in any order "
        "(hostile headers and body modes, subset hints of any shape, bodies valid, mutated or arbitrary, any "
        f"`:status`, server-sent events or bytes back). Streams ended: {codes}. Immediate responses by status: "
        f"{immediates}.",
        "",
        "| picker failures | unexpected errors in the log | picked | recorded | recorded twice | picked, not "
        "recorded | records with negative tokens or cost | leases left | in flight left |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {r['failures']} | {r['unexpected_in_log']} | {r['picked']} | {r['recorded']} | {r['recorded_twice']} | "
        f"{r['picked_unrecorded']} | {r['negative_records']} | {r['leases_left']:g} | {r['inflight_left']} |",
        "",
        f"Targets (no failure; every request recorded at most once, every pick exactly once, none with a "
        f"negative count; nothing held afterwards): {'met' if met(r) else '**missed**'}.",
        "",
    ]
    return lines + examples_block(r["failure_examples"])

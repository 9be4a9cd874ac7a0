"""The ext_proc state machine with Envoy-shaped messages and a fake decider: the order and shape of
the responses the endpoint-picker protocol requires, and settlement exactly once however it ends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.epp import protocol
from gateway.epp.exchange import Exchange, Picked, Refused
from gateway.epp.protocol import envoy

E = envoy()


@dataclass
class FakeFollower:
    chunks: list[bytes] = field(default_factory=list)
    finished: list[tuple[bool, str | None]] = field(default_factory=list)
    observed: list[bool] = field(default_factory=list)
    status: int | None = None

    def response_headers(self, status: int, headers: dict[str, str]) -> list[tuple[str, str]]:
        self.status = status
        return [("x-tokenway-endpoint", "p/e0")]

    def body_chunk(self, chunk: bytes, end_of_stream: bool) -> bytes:
        self.chunks.append(chunk)
        return chunk.upper()

    def finish(self, complete: bool, served: str | None, observed: bool = True) -> None:
        self.finished.append((complete, served))
        self.observed.append(observed)


@dataclass
class FakeDecider:
    outcome: Picked | Refused
    seen: list[tuple[dict[str, str], bytes, Sequence[str] | None]] = field(default_factory=list)

    async def decide(self, headers: dict[str, str], body: bytes, subset: Sequence[str] | None) -> Picked | Refused:
        self.seen.append((headers, body, subset))
        return self.outcome


def headers_message(
    headers: dict[str, str],
    *,
    end_of_stream: bool = False,
    subset: list[str] | None = None,
    modes: tuple[int, int] | None = None,
) -> Any:
    values = [E.base.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    message = E.ext_proc.ProcessingRequest(
        request_headers=E.ext_proc.HttpHeaders(headers=E.base.HeaderMap(headers=values), end_of_stream=end_of_stream)
    )
    if modes is not None:  # Envoy's protocol_config, in the first message of the stream
        message.protocol_config.request_body_mode, message.protocol_config.response_body_mode = modes
    if subset is not None:
        message.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update({protocol.SUBSET: subset})
    return message


def body_message(body: bytes, end_of_stream: bool) -> Any:
    return E.ext_proc.ProcessingRequest(request_body=E.ext_proc.HttpBody(body=body, end_of_stream=end_of_stream))


def response_headers_message(status: str) -> Any:
    header = E.base.HeaderValue(key=":status", raw_value=status.encode())
    return E.ext_proc.ProcessingRequest(
        response_headers=E.ext_proc.HttpHeaders(headers=E.base.HeaderMap(headers=[header]))
    )


def response_body_message(body: bytes, end_of_stream: bool, served: str | None = None) -> Any:
    message = E.ext_proc.ProcessingRequest(response_body=E.ext_proc.HttpBody(body=body, end_of_stream=end_of_stream))
    if served:
        message.metadata_context.filter_metadata[protocol.LB_NAMESPACE].update({protocol.SERVED: served})
    return message


def destination(response: Any) -> tuple[str, str]:
    header = {
        o.header.key: o.header.raw_value.decode() for o in response.request_headers.response.header_mutation.set_headers
    }[protocol.DESTINATION]
    meta = response.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value.fields[protocol.DESTINATION]
    return header, meta.string_value


async def test_picked_request_and_followed_response() -> None:
    follower = FakeFollower()
    decider = FakeDecider(Picked(["10.0.0.1:8000", "10.0.0.2:8000"], b'{"model":"served"}', follower))
    exchange = Exchange(E, decider, max_body_bytes=1 << 20)
    assert await exchange.on(headers_message({":path": "/v1/chat/completions", "authorization": "Bearer k"},
                                             subset=["10.0.0.1:8000", "10.0.0.2:8000"])) == []  # fmt: skip
    assert await exchange.on(body_message(b'{"model":', False)) == []
    first, second = await exchange.on(body_message(b'"public"}', True))
    assert destination(first) == ("10.0.0.1:8000,10.0.0.2:8000",) * 2  # header and metadata agree
    assert first.request_headers.response.clear_route_cache
    streamed = second.request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b'{"model":"served"}', True)
    headers, body, subset = decider.seen[0]
    assert body == b'{"model":"public"}' and headers["authorization"] == "Bearer k"
    assert subset == ["10.0.0.1:8000", "10.0.0.2:8000"]
    [answer] = await exchange.on(response_headers_message("200"))
    added = answer.response_headers.response.header_mutation.set_headers
    assert [(o.header.key, o.header.raw_value) for o in added] == [("x-tokenway-endpoint", b"p/e0")]
    assert follower.status == 200
    [chunk] = await exchange.on(response_body_message(b"data: a\n\n", False))
    assert chunk.response_body.response.body_mutation.streamed_response.body == b"DATA: A\n\n"
    [last] = await exchange.on(response_body_message(b"", True, served="10.0.0.2:8000"))
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream
    assert follower.finished == [(True, "10.0.0.2:8000")]
    exchange.close()
    assert follower.finished == [(True, "10.0.0.2:8000")]  # exactly once


async def test_a_cut_stream_settles_once_on_close() -> None:
    follower = FakeFollower()
    exchange = Exchange(E, FakeDecider(Picked(["10.0.0.1:8000"], b"{}", follower)), max_body_bytes=1 << 20)
    await exchange.on(headers_message({":path": "/v1/completions"}))
    await exchange.on(body_message(b"{}", True))
    await exchange.on(response_headers_message("200"))
    await exchange.on(response_body_message(b"data: x\n\n", False))
    exchange.close()
    exchange.close()
    assert follower.finished == [(False, None)]


async def test_with_no_response_body_the_streams_end_is_the_answers() -> None:
    """`response_body_mode: NONE`: the body never comes; the stream's end finishes the request as
    served but unobserved (not as a cut stream), once."""
    follower = FakeFollower()
    exchange = Exchange(E, FakeDecider(Picked(["10.0.0.1:8000"], b"{}", follower)), max_body_bytes=1 << 20)
    modes = (protocol.FULL_DUPLEX_STREAMED, protocol.NONE)
    await exchange.on(headers_message({":path": "/v1/completions"}, modes=modes))
    await exchange.on(body_message(b"{}", True))
    await exchange.on(response_headers_message("200"))
    assert follower.finished == []  # the engine may still be answering
    exchange.close()
    exchange.close()
    assert (follower.finished, follower.observed) == ([(True, None)], [False])


async def test_refused_is_an_immediate_response() -> None:
    refused = Refused(429, b'{"error":{}}', [("retry-after", "2")], details="rate_limited")
    exchange = Exchange(E, FakeDecider(refused), max_body_bytes=1 << 20)
    await exchange.on(headers_message({":path": "/v1/chat/completions"}))
    [answer] = await exchange.on(body_message(b"{}", True))
    immediate = answer.immediate_response
    assert immediate.status.code == 429 and immediate.body == b'{"error":{}}' and immediate.details == "rate_limited"
    assert ("retry-after", b"2") in [(o.header.key, o.header.raw_value) for o in immediate.headers.set_headers]
    assert exchange.refused is refused


@pytest.mark.parametrize("chunks", [1, 3], ids=["one-chunk", "three-chunks"])
async def test_a_body_over_the_limit_is_a_413(chunks: int) -> None:
    decider = FakeDecider(Refused(500, b""))
    exchange = Exchange(E, decider, max_body_bytes=10)
    await exchange.on(headers_message({":path": "/v1/chat/completions"}))
    answers: list[Any] = []
    for i in range(chunks):
        answers += await exchange.on(body_message(b"x" * (11 // chunks + 1), i == chunks - 1))
    assert [a.immediate_response.status.code for a in answers] == [413]
    assert decider.seen == []


async def test_a_request_without_body_is_decided_on_its_headers() -> None:
    follower = FakeFollower()
    exchange = Exchange(E, FakeDecider(Picked(["10.0.0.9:80"], b"", follower)), max_body_bytes=10)
    [answer] = await exchange.on(headers_message({":path": "/v1/models", ":method": "GET"}, end_of_stream=True))
    assert destination(answer)[0] == "10.0.0.9:80"


def set_headers(common: Any) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


@pytest.mark.parametrize("changed", [True, False], ids=["changed", "unchanged"])
async def test_full_duplex_drops_the_clients_content_length_only_for_a_changed_body(changed: bool) -> None:
    picked = Picked(["10.0.0.1:8000"], b'{"model":"m"}', FakeFollower(), body_changed=changed)
    exchange = Exchange(E, FakeDecider(picked), max_body_bytes=1 << 20)
    await exchange.on(headers_message({":path": "/v1/chat/completions", "content-length": "30"}))
    first, second = await exchange.on(body_message(b'{"model":"m","priority":2}', True))
    removed = list(first.request_headers.response.header_mutation.remove_headers)
    assert removed == (["content-length"] if changed else [])
    assert second.request_body.response.body_mutation.streamed_response.body == b'{"model":"m"}'


BUFFERED = (protocol.BUFFERED, protocol.BUFFERED)


async def test_buffered_the_pick_and_the_changed_body_come_with_the_body_response() -> None:
    follower = FakeFollower()
    exchange = Exchange(E, FakeDecider(Picked(["10.0.0.1:8000"], b'{"model":"m"}', follower)), max_body_bytes=1 << 20)
    [first] = await exchange.on(headers_message({":path": "/v1/chat/completions"}, modes=BUFFERED))
    assert first.WhichOneof("response") == "request_headers"  # answered at once: Envoy waits for it
    assert not first.request_headers.response.header_mutation.set_headers and not first.HasField("dynamic_metadata")
    [second] = await exchange.on(body_message(b'{"model":"m","kv_transfer_params":{}}', True))
    common = second.request_body.response
    assert set_headers(common) == {protocol.DESTINATION: "10.0.0.1:8000", "content-length": "13"}
    assert common.body_mutation.body == b'{"model":"m"}' and common.clear_route_cache
    lb = second.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value.fields
    assert lb[protocol.DESTINATION].string_value == "10.0.0.1:8000"
    await exchange.on(response_headers_message("200"))
    [answer] = await exchange.on(response_body_message(b"whole answer", True))
    passed = answer.response_body.response
    assert passed.body_mutation.body == b"WHOLE ANSWER" and set_headers(passed) == {"content-length": "12"}
    assert follower.finished == [(True, None)]


async def test_buffered_an_unchanged_body_is_not_mutated() -> None:
    picked = Picked(["10.0.0.1:8000"], b'{"model":"m"}', FakeFollower(), body_changed=False)
    exchange = Exchange(E, FakeDecider(picked), max_body_bytes=1 << 20)
    await exchange.on(headers_message({":path": "/v1/chat/completions"}, modes=BUFFERED))
    [second] = await exchange.on(body_message(b'{"model":"m"}', True))
    common = second.request_body.response
    assert common.body_mutation.WhichOneof("mutation") is None
    assert set_headers(common) == {protocol.DESTINATION: "10.0.0.1:8000"}  # no content-length: the client's holds


async def test_the_configured_mode_is_assumed_when_envoy_announces_none() -> None:
    exchange = Exchange(E, FakeDecider(Picked(["10.0.0.1:8000"], b"{}", FakeFollower())), 1 << 20, protocol.BUFFERED)
    [first] = await exchange.on(headers_message({":path": "/v1/chat/completions"}))
    assert first.WhichOneof("response") == "request_headers"


@pytest.mark.parametrize("mode", [protocol.NONE, protocol.STREAMED, protocol.BUFFERED_PARTIAL])
async def test_a_request_body_mode_that_cannot_carry_the_pick_is_refused(mode: int) -> None:
    decider = FakeDecider(Picked(["10.0.0.1:8000"], b"{}", FakeFollower()))
    exchange = Exchange(E, decider, max_body_bytes=1 << 20)
    [answer] = await exchange.on(headers_message({":path": "/v1/chat/completions"}, modes=(mode, mode)))
    assert answer.immediate_response.status.code == 500 and b"FULL_DUPLEX_STREAMED" in answer.immediate_response.body
    assert decider.seen == []


async def test_trailers_end_the_request_and_the_response() -> None:
    """FULL_DUPLEX_STREAMED needs trailers SEND: a body can end with trailers instead of end_of_stream."""
    follower = FakeFollower()
    exchange = Exchange(E, FakeDecider(Picked(["10.0.0.1:8000"], b"{}", follower)), max_body_bytes=1 << 20)
    await exchange.on(headers_message({":path": "/v1/chat/completions"}))
    assert await exchange.on(body_message(b"{}", False)) == []
    trailers = E.ext_proc.ProcessingRequest(request_trailers=E.ext_proc.HttpTrailers())
    picked, body, answered = await exchange.on(trailers)
    assert destination(picked)[0] == "10.0.0.1:8000"
    assert not body.request_body.response.body_mutation.streamed_response.end_of_stream  # the trailers end it
    assert answered.WhichOneof("response") == "request_trailers"
    await exchange.on(response_headers_message("200"))
    await exchange.on(response_body_message(b"data: x\n\n", False))
    held, done = await exchange.on(E.ext_proc.ProcessingRequest(response_trailers=E.ext_proc.HttpTrailers()))
    assert held.WhichOneof("response") == "response_body" and done.WhichOneof("response") == "response_trailers"
    assert follower.chunks == [b"data: x\n\n", b""]  # the follower was asked for what it still held
    assert follower.finished == [(True, None)]


@pytest.mark.parametrize("end_of_stream", [True, False])
async def test_headers_again_after_the_pick_decide_nothing_and_settle_nothing_twice(end_of_stream: bool) -> None:
    """One stream is one request: request headers sent again after the decision (a data plane out of
    protocol) neither make a second reservation nor lose the first one's settlement."""
    follower = FakeFollower()
    decider = FakeDecider(Picked(["10.0.0.1:8000"], b"{}", follower))
    exchange = Exchange(E, decider, max_body_bytes=1 << 20)
    headers = {":path": "/v1/chat/completions"}
    assert len(await exchange.on(headers_message(headers, end_of_stream=True))) == 1
    assert await exchange.on(headers_message(headers, end_of_stream=end_of_stream)) == []
    assert await exchange.on(body_message(b"{}", True)) == []
    assert len(decider.seen) == 1
    exchange.close()
    assert follower.finished == [(False, None)]


@pytest.mark.parametrize(
    ("status", "read"),
    [("200", 200), ("429", 429), ("", 200), ("abc", 502), ("\ufffd", 502), ("2000", 502), ("099", 502)],
)
async def test_a_response_status_that_is_not_one_is_read_as_a_bad_gateway(status: str, read: int) -> None:
    follower = FakeFollower()
    exchange = Exchange(E, FakeDecider(Picked(["10.0.0.1:8000"], b"{}", follower)), max_body_bytes=1 << 20)
    await exchange.on(headers_message({":path": "/v1/chat/completions"}, end_of_stream=True))
    [answer] = await exchange.on(response_headers_message(status))
    assert answer.WhichOneof("response") == "response_headers"
    assert follower.status == read

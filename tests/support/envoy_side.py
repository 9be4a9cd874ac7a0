"""Envoy's side of the endpoint-picker protocol, for tests: an ext_proc client in
FULL_DUPLEX_STREAMED mode (or, `buffered=True`, BUFFERED request and response bodies, announced in
`protocol_config` as Envoy does) plus the router that sends the request where the picker said.

Per request it does what Envoy's ext_proc filter and router do with an InferencePool backend: one
`Process` stream; the request headers, then the body in chunks; it waits for the headers response
(the picked `x-gateway-destination-endpoint`, as a header and as dynamic metadata) and the body
response (the body to send); it POSTs that body to the first endpoint over real HTTP; and it shows
the picker the response (headers, then each body chunk, answered one by one, then the end of
stream with `x-gateway-destination-endpoint-served` in the metadata context), keeping what the
picker passes on. An immediate response ends the exchange with that answer.

BUFFERED: the headers response comes first (without a pick), then the whole body goes in one message
and its answer carries the pick, and a body mutation and `content-length` only when the body
changed; the response body is shown whole and sent on as the answer's mutation says.

`running_picker` starts `tokenway epp` over simulated engines and `envoy_pair` gives a test this
Envoy side with an HTTP session for its router: what every endpoint-picker test starts from.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from gateway.epp import protocol
from gateway.epp.protocol import Envoy, envoy
from tests.support.procs import Gateway, SimEngines, free_port, running, start_gateway


@dataclass
class Answer:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)  # what the picker added (request and response)
    endpoint: str | None = None  # the endpoint Envoy sent the request to
    metadata_endpoint: str | None = None  # the same, from the dynamic metadata
    immediate: bool = False
    forwarded_body: bytes = b""  # the request body the picker had Envoy send
    body_mutated: bool = False  # the picker replaced the request body (BUFFERED: a body mutation)
    removed: list[str] = field(default_factory=list)  # request headers the picker removed


class EnvoySide:
    def __init__(self, address: str) -> None:
        self.address = address
        self.envoy: Envoy = envoy()
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = self.envoy.ext_proc_grpc.ExternalProcessorStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    def _headers(
        self,
        headers: dict[str, str],
        end_of_stream: bool,
        subset: Sequence[str] | None,
        buffered: bool = False,
        response_body: bool = True,
    ) -> Any:
        e = self.envoy
        values = [e.base.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
        message = e.ext_proc.ProcessingRequest(
            request_headers=e.ext_proc.HttpHeaders(
                headers=e.base.HeaderMap(headers=values), end_of_stream=end_of_stream
            )
        )
        mode = protocol.BUFFERED if buffered else protocol.FULL_DUPLEX_STREAMED
        message.protocol_config.request_body_mode = mode
        message.protocol_config.response_body_mode = mode if response_body else protocol.NONE
        if subset is not None:
            message.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update({protocol.SUBSET: list(subset)})
        return message

    async def request(
        self,
        path: str,
        headers: dict[str, str],
        body: bytes,
        *,
        subset: Sequence[str] | None = None,
        cut_after_chunks: int | None = None,
        session: aiohttp.ClientSession,
        buffered: bool = False,
        response_body: bool = True,
    ) -> Answer:
        """One request as Envoy plays it; `response_body=False`: `response_body_mode: NONE` (the
        answer goes to the client without passing the picker, which sees only its headers)."""
        if buffered:
            return await self._buffered(path, headers, body, subset=subset, session=session)
        e = self.envoy
        call = self.stub.Process()
        try:
            await call.write(
                self._headers({":method": "POST", ":path": path, **headers}, False, subset, response_body=response_body)
            )
            half = max(len(body) // 2, 1)
            for i, piece in enumerate((body[:half], body[half:])):
                await call.write(
                    e.ext_proc.ProcessingRequest(request_body=e.ext_proc.HttpBody(body=piece, end_of_stream=i == 1))
                )
            first = await call.read()
            if first.WhichOneof("response") == "immediate_response":
                immediate = first.immediate_response
                added = {o.header.key: o.header.raw_value.decode() for o in immediate.headers.set_headers}
                return Answer(immediate.status.code, immediate.body, added, immediate=True)
            assert first.WhichOneof("response") == "request_headers", first
            added = {
                o.header.key: o.header.raw_value.decode()
                for o in first.request_headers.response.header_mutation.set_headers
            }
            lb = first.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value.fields
            metadata_endpoint = lb[protocol.DESTINATION].string_value
            endpoint = added[protocol.DESTINATION].split(",")[0]
            second = await call.read()
            assert second.WhichOneof("response") == "request_body", second
            forwarded = second.request_body.response.body_mutation.streamed_response.body
            answer = Answer(0, b"", added, endpoint, metadata_endpoint, forwarded_body=forwarded)
            answer.body_mutated = forwarded != body
            answer.removed = list(first.request_headers.response.header_mutation.remove_headers)
            async with session.post(
                f"http://{endpoint}{path}", data=forwarded, headers={"content-type": "application/json"}
            ) as upstream:
                answer.status = upstream.status
                response_headers = {
                    ":status": str(upstream.status),
                    "content-type": upstream.headers.get("content-type", ""),
                }
                await self._show_response_headers(call, response_headers, answer)
                if not response_body:  # the body goes to the client past the picker; the stream ends
                    answer.body = await upstream.read()
                    await call.done_writing()
                    return answer
                chunks = 0
                out = bytearray()
                async for chunk in upstream.content.iter_any():
                    await call.write(e.ext_proc.ProcessingRequest(response_body=e.ext_proc.HttpBody(body=chunk)))
                    passed = await call.read()
                    out += passed.response_body.response.body_mutation.streamed_response.body
                    chunks += 1
                    if cut_after_chunks is not None and chunks >= cut_after_chunks:
                        call.cancel()  # the client went away: Envoy ends the ext_proc stream
                        answer.body = bytes(out)
                        return answer
                last = e.ext_proc.ProcessingRequest(response_body=e.ext_proc.HttpBody(body=b"", end_of_stream=True))
                last.metadata_context.filter_metadata[protocol.LB_NAMESPACE].update({protocol.SERVED: endpoint})
                await call.write(last)
                passed = await call.read()
                out += passed.response_body.response.body_mutation.streamed_response.body
                answer.body = bytes(out)
            await call.done_writing()
            return answer
        finally:
            if not call.done():
                call.cancel()

    async def _buffered(
        self,
        path: str,
        headers: dict[str, str],
        body: bytes,
        *,
        subset: Sequence[str] | None,
        session: aiohttp.ClientSession,
    ) -> Answer:
        e = self.envoy
        call = self.stub.Process()
        try:
            await call.write(self._headers({":method": "POST", ":path": path, **headers}, False, subset, True))
            first = await call.read()
            if first.WhichOneof("response") == "immediate_response":
                return _immediate(first)
            assert first.WhichOneof("response") == "request_headers", first
            assert not first.request_headers.response.header_mutation.set_headers  # the pick waits for the body
            await call.write(
                e.ext_proc.ProcessingRequest(request_body=e.ext_proc.HttpBody(body=body, end_of_stream=True))
            )
            second = await call.read()
            if second.WhichOneof("response") == "immediate_response":
                return _immediate(second)
            assert second.WhichOneof("response") == "request_body", second
            common = second.request_body.response
            added = {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}
            lb = second.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value.fields
            endpoint = added[protocol.DESTINATION].split(",")[0]
            mutated = common.body_mutation.WhichOneof("mutation") == "body"
            forwarded = common.body_mutation.body if mutated else body
            answer = Answer(0, b"", added, endpoint, lb[protocol.DESTINATION].string_value, forwarded_body=forwarded)
            answer.body_mutated = mutated
            length = int(added.get("content-length", len(body)))
            assert length == len(forwarded), "the content-length Envoy sends on must match the body"
            async with session.post(
                f"http://{endpoint}{path}", data=forwarded, headers={"content-type": "application/json"}
            ) as upstream:
                answer.status = upstream.status
                await self._show_response_headers(call, {":status": str(upstream.status)}, answer)
                whole = await upstream.read()
            last = e.ext_proc.ProcessingRequest(response_body=e.ext_proc.HttpBody(body=whole, end_of_stream=True))
            last.metadata_context.filter_metadata[protocol.LB_NAMESPACE].update({protocol.SERVED: endpoint})
            await call.write(last)
            passed = (await call.read()).response_body.response
            answer.body = passed.body_mutation.body if passed.body_mutation.WhichOneof("mutation") == "body" else whole
            await call.done_writing()
            return answer
        finally:
            if not call.done():
                call.cancel()

    async def _show_response_headers(self, call: Any, headers: dict[str, str], answer: Answer) -> None:
        """The engine's response headers to the picker; what it sets on them goes into `answer`."""
        e = self.envoy
        values = [e.base.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
        await call.write(
            e.ext_proc.ProcessingRequest(
                response_headers=e.ext_proc.HttpHeaders(headers=e.base.HeaderMap(headers=values))
            )
        )
        headers_answer = await call.read()
        for o in headers_answer.response_headers.response.header_mutation.set_headers:
            answer.headers[o.header.key] = o.header.raw_value.decode()


def _immediate(message: Any) -> Answer:
    immediate = message.immediate_response
    added = {o.header.key: o.header.raw_value.decode() for o in immediate.headers.set_headers}
    return Answer(immediate.status.code, immediate.body, added, immediate=True)


@dataclass
class Picker:
    gateway: Gateway  # the HTTP side (health, metrics, admin)
    grpc_port: int
    engines: SimEngines

    @property
    def hosts(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.engines.ports]


@contextlib.contextmanager
def running_picker(
    workdir: Path, engines: SimEngines, *, pools: list[dict[str, Any]], policies: dict[str, Any], **sections: Any
) -> Iterator[Picker]:
    """`tokenway epp` serving `pools` of these engines until the block ends; the engines stop with it.
    `sections`: more gateway.yaml sections (a ledger, say)."""
    with running(engines):
        grpc_port = free_port()
        gateway = start_gateway(
            workdir,
            command="epp",
            pools=pools,
            policies=policies,
            server={"drain_timeout_s": 2},
            epp={"host": "127.0.0.1", "port": grpc_port},
            backends={"health_interval_s": 0.2},
            predictor={"enabled": False},
            **sections,
        )
        with running(gateway):
            yield Picker(gateway, grpc_port, engines)


@contextlib.asynccontextmanager
async def envoy_pair(picker: Picker) -> AsyncIterator[tuple[EnvoySide, aiohttp.ClientSession]]:
    """An Envoy side talking to the picker, and the session its router sends requests on."""
    side = EnvoySide(f"127.0.0.1:{picker.grpc_port}")
    async with aiohttp.ClientSession() as session:
        yield side, session
    await side.close()

"""Streamed completions as pre-encoded bytes, written by the engine loop straight to the socket.

A token chunk is the same JSON every time but for its text, so it is encoded once per request, split
where the text goes (`ChunkTemplate`); the text of each vocabulary id is JSON-escaped once per
process (`text_gen.json_text`). A step's tokens then cost one bytes format and one socket write per
streaming request, called from the engine loop (`TokenWriter.step` is the request's `notify`), without
waking the request's handler: the handler only writes the role chunk before and the final chunk,
usage, ``[DONE]`` and the end of the body after.

The bytes are what ``orjson.dumps`` gives for the chunk dict the handler used to build, framed as an
HTTP/1.1 chunk when the response is chunked. A client that stops reading does not grow the
transport's buffer without bound: past `WRITE_BUFFER_LIMIT` tokens are held back and go out together
in a later step's chunk (or the final one), as they would from a handler blocked on drain.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from sim import text_gen
from sim.request import Request, Status

WRITE_BUFFER_LIMIT = 256 * 1024
_FINISHED = Status.FINISHED
_SENTINEL = "\x01"
_SENTINEL_JSON = b'"\\u0001"'


class ChunkTemplate:
    """``data: {chunk}\\n\\n`` of a token chunk, as `head + text + tail` (text JSON-escaped)."""

    __slots__ = ("fixed", "head", "tail")

    def __init__(self, base: dict[str, Any], chat: bool) -> None:
        choice: dict[str, Any]
        if chat:
            choice = {"index": 0, "delta": {"content": _SENTINEL}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": _SENTINEL, "logprobs": None, "finish_reason": None}
        encoded = b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"
        head, found, tail = encoded.rpartition(_SENTINEL_JSON)  # the text comes after id and model
        assert found, "chunk template without its text slot"
        self.head = head + b'"'
        self.tail = b'"' + tail
        self.fixed = len(self.head) + len(self.tail)

    def event(self, text: bytes) -> bytes:
        return self.head + text + self.tail


class TokenWriter:
    """`step` is a streaming request's `notify`: after each step, its new tokens as one chunk on the
    socket; once it has finished, resolves `done` for the handler to write the end of the stream.
    (A bound method: called once per token, it is cheaper to call than an instance's __call__.)"""

    __slots__ = ("chunked", "done", "fixed", "head", "req", "sent", "table", "tail", "transport")

    def __init__(
        self,
        req: Request,
        transport: asyncio.WriteTransport,
        template: ChunkTemplate,
        chunked: bool,
        done: asyncio.Future[None],
    ) -> None:
        self.req = req
        self.transport = transport
        self.head, self.tail, self.fixed = template.head, template.tail, template.fixed
        self.chunked = chunked
        self.done = done
        self.sent = 0  # output tokens already on the wire
        self.table = text_gen.json_text()

    def step(self) -> None:
        req = self.req
        if req.status is _FINISHED:
            if not self.done.done():
                self.done.set_result(None)
            return
        produced = req.num_output
        sent = self.sent
        if produced <= sent:
            return
        transport = self.transport
        if transport.is_closing() or transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
            return
        table = self.table
        ids = req.output_ids
        text = table[ids[sent]] if produced == sent + 1 else b"".join([table[i] for i in ids[sent:produced]])
        self.sent = produced
        if self.chunked:
            transport.write(b"%x\r\n%b%b%b\r\n" % (self.fixed + len(text), self.head, text, self.tail))
        else:
            transport.write(self.head + text + self.tail)


class FinishWaiter:
    """`step` is a non-streaming request's `notify`: resolves `done` once the request has finished."""

    __slots__ = ("done", "req")

    def __init__(self, req: Request, done: asyncio.Future[None]) -> None:
        self.req = req
        self.done = done

    def step(self) -> None:
        if self.req.status is _FINISHED and not self.done.done():
            self.done.set_result(None)

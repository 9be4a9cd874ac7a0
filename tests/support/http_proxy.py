"""A forward HTTP proxy on loopback, for tests of clients that honour `http_proxy`: it reads the first
request of each connection (absolute-form, as clients write them to a proxy), records its target, and
pipes the connection to that origin unchanged (origin servers accept absolute-form: RFC 9112, 3.2.2)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(slots=True)
class ForwardProxy:
    url: str = ""
    targets: list[str] = field(default_factory=list)  # the first request-target of each connection

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        target = head.split(b" ", 2)[1].decode()
        self.targets.append(target)
        parts = urlsplit(target)
        origin_reader, origin_writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        origin_writer.write(head)
        await asyncio.gather(_pipe(reader, origin_writer), _pipe(origin_reader, writer), return_exceptions=True)


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    finally:
        sink.close()


@contextlib.asynccontextmanager
async def forward_proxy() -> AsyncIterator[ForwardProxy]:
    """A running proxy on the current loop (`proxy.url` is its `http://127.0.0.1:PORT`)."""
    proxy = ForwardProxy()
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    proxy.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield proxy
    finally:
        server.close()

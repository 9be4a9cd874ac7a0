"""A bare aiohttp + uvloop pass-through proxy: the floor tokenway's overhead is measured against.

It reads the body, forwards it on one pooled ClientSession, and returns the upstream bytes: no
parsing, no auth, no accounting.
"""

from __future__ import annotations

import sys

import aiohttp
import uvloop
from aiohttp import web


def main() -> None:
    port, upstream = int(sys.argv[1]), sys.argv[2]

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        async with request.app["session"].post(
            upstream + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as response:
            data = await response.read()
            return web.Response(status=response.status, body=data, content_type="application/json")

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", forward)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__":
    main()

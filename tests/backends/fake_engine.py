"""A tiny in-process HTTP engine for health and scraping tests: scripted status codes and bodies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeEngine:
    """Routes answer `responses[path] = (status, body, headers)`; unknown paths 404. Counts hits."""

    responses: dict[str, tuple[int, str, dict[str, str]]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    base_url: str = ""

    def set(self, path: str, status: int, body: str = "", headers: dict[str, str] | None = None) -> None:
        self.responses[path] = (status, body, headers or {})

    async def handle(self, request: web.Request) -> web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        status, body, headers = self.responses.get(request.path, (404, "not found", {}))
        return web.Response(status=status, text=body, headers=headers)


@asynccontextmanager
async def fake_engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engine.base_url = f"http://127.0.0.1:{port}"
    try:
        yield engine
    finally:
        await runner.cleanup()

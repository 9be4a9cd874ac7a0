"""`tokenway epp`: the gateway's app (pools, discovery, policies, admission, router, predictor,
hooks, metrics, ledger, admin API on the HTTP port) plus the ext_proc gRPC listener Envoy calls.

The HTTP port keeps `/healthz`, `/readyz`, `/metrics` and `/admin/*` (and would serve the OpenAI API
too, for clients that bypass the data plane); the decisions on both ports share one router, one
limiter and one predictor.

## The gRPC side (`EppServer`)

The gRPC side of `tokenway epp`: Envoy's ExternalProcessor service and gRPC health checks.

One `Exchange` per ext_proc stream (one HTTP request); however the stream ends (Envoy's end of
stream, a cancel because the client went away, an error), `Exchange.close` runs, so the request's
reservation and load are settled exactly once.

Health (gRPC Health Checking Protocol, as the endpoint-picker protocol asks): `liveness` is
SERVING while the process answers; `readiness`, the empty service name and
`envoy.service.ext_proc.v3.ExternalProcessor` are SERVING while every pool has a ready endpoint
(re-checked every second), NOT_SERVING otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.app import keys as appkeys
from gateway.app.factory import create_app
from gateway.app.settings import GatewaySettings
from gateway.epp import protocol
from gateway.epp.decide import EppDecider
from gateway.epp.exchange import Decider, Exchange
from gateway.epp.protocol import FULL_DUPLEX_STREAMED, Envoy, envoy
from gateway.transport.engine import EngineTransport
from gateway.transport.hosted import PoolTransports

log = logging.getLogger("tokenway.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)


class ExternalProcessor:
    """The servicer (duck-typed: grpc only looks for a `Process` method)."""

    def __init__(self, envoy: Envoy, decider: Decider, max_body_bytes: int, request_mode: int) -> None:
        self.envoy = envoy
        self.decider = decider
        self.max_body_bytes = max_body_bytes
        self.request_mode = request_mode
        self.streams = 0
        self.open_streams = 0

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # gRPC's method name
        exchange = Exchange(self.envoy, self.decider, self.max_body_bytes, self.request_mode)
        self.streams += 1
        self.open_streams += 1
        try:
            async for message in requests:
                for response in await exchange.on(message):
                    yield response
                if exchange.refused is not None:
                    return  # an immediate response ends the exchange
        finally:
            self.open_streams -= 1
            exchange.close()


class EppServer:
    def __init__(
        self,
        envoy: Envoy,
        decider: Decider,
        *,
        host: str,
        port: int,
        ready: Callable[[], bool],
        max_body_bytes: int,
        request_mode: int = FULL_DUPLEX_STREAMED,
    ) -> None:
        self.processor = ExternalProcessor(envoy, decider, max_body_bytes, request_mode)
        self.health = health.aio.HealthServicer()
        self._ready = ready
        self._envoy = envoy
        self.address = f"{host}:{port}"
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        envoy.ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.processor, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(self.address)
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._set_ready()
        await self.server.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_ready())
        log.info("endpoint picker (ext_proc) listening on %s", self.address)

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def _set_ready(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self._ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in READY_SERVICES:
            await self.health.set(service, status)

    async def _watch_ready(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self._set_ready()


EPP_SERVER = web.AppKey("epp_server", EppServer)
EPP_DECIDER = web.AppKey("epp_decider", EppDecider)


def create_epp_app(settings: GatewaySettings) -> web.Application:
    app = create_app(settings)
    app.cleanup_ctx.append(_epp_ctx)
    return app


async def _epp_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[appkeys.SETTINGS].epp
    director = app[appkeys.DIRECTOR]
    fleet = app[appkeys.FLEET]
    engine = director.transport  # what an endpoint is sent is the HTTP gateway's (Envoy sends it)
    if isinstance(engine, PoolTransports):  # hosted pools are the gateway's own calls, not Envoy's
        engine = engine.engine
    assert isinstance(engine, EngineTransport)
    decider = EppDecider(director=director, engine=engine)

    def ready() -> bool:
        return bool(fleet.pools) and all(pool.has_ready for pool in fleet.pools.values())

    server = EppServer(
        envoy(),
        decider,
        host=config.host,
        port=config.port,
        ready=ready,
        max_body_bytes=config.max_body_bytes,
        request_mode=protocol.MODE_BY_NAME[config.request_body_mode],
    )
    app[EPP_SERVER], app[EPP_DECIDER] = server, decider
    await server.start()
    print(f"tokenway endpoint picker (ext_proc gRPC) on {config.host}:{server.port}", flush=True)
    yield
    await server.stop(config.grace_s)

"""The gRPC side of `tokenway epp`: Envoy's ExternalProcessor service and gRPC health checks.

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
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp.exchange import Decider, Exchange
from gateway.epp.protocol import FULL_DUPLEX_STREAMED
from gateway.epp.protos import Envoy

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

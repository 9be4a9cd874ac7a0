"""`tokenway epp`: the gateway's app (pools, discovery, policies, admission, router, predictor,
hooks, metrics, ledger, admin API on the HTTP port) plus the ext_proc gRPC listener Envoy calls.

The HTTP port keeps `/healthz`, `/readyz`, `/metrics` and `/admin/*` (and would serve the OpenAI API
too, for clients that bypass the data plane); the decisions on both ports share one router, one
limiter and one predictor.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from gateway.app import keys as appkeys
from gateway.app.factory import create_app
from gateway.app.settings import GatewaySettings
from gateway.epp import protocol
from gateway.epp.decide import EppDecider
from gateway.epp.protos import envoy
from gateway.epp.server import EppServer
from gateway.transport.engine import EngineTransport
from gateway.transport.hosted import PoolTransports

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

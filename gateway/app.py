"""The app factory: builds every long-lived object in `cleanup_ctx` generators (set up before the
yield, torn down after, in reverse order) and stores them under typed AppKeys. Nothing here runs at
import time, so tests can build several apps in one process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from backends.fleet import Fleet
from backends.types import EndpointState
from gateway import appkeys
from gateway.admin import admin_routes
from gateway.components import OpenAdmission
from gateway.pipeline import Pipeline, PolicySource
from gateway.routes import METRICS_RENDER, setup_routes
from gateway.settings import GatewaySettings, load_yaml_model
from policies.policy import Policy
from policies.routing.least_inflight import LeastInflightRouter
from policies.schema import PoliciesConfig

log = logging.getLogger("tokenway.app")


def create_app(settings: GatewaySettings, *, policy: Policy | None = None) -> web.Application:
    app = web.Application(client_max_size=settings.server.max_body_bytes)
    app[appkeys.SETTINGS] = settings
    app[METRICS_RENDER] = lambda: b""
    app.cleanup_ctx.append(_session_ctx)
    app.cleanup_ctx.append(_policies_ctx(policy))
    app.cleanup_ctx.append(_fleet_ctx)
    app.cleanup_ctx.append(_pipeline_ctx)
    setup_routes(app, admin_routes())
    return app


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    """One upstream session for every request: pooled keep-alive connections to the engines."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    app[appkeys.SESSION] = session
    yield
    await session.close()


def _policies_ctx(policy: Policy | None) -> Any:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[appkeys.SETTINGS]
        current = policy
        if current is None:
            path = settings.resolve_path(settings.policies)
            current = Policy(load_yaml_model(path, PoliciesConfig), source=str(path))
        app[appkeys.POLICIES] = PolicySource(current)
        yield

    return ctx


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[appkeys.SETTINGS]
    fleet = Fleet.from_configs(settings.pools)
    app[appkeys.FLEET] = fleet
    probe = asyncio.get_running_loop().create_task(_probe_static(fleet, app[appkeys.SESSION]))
    yield
    probe.cancel()


async def _probe_static(fleet: Fleet, session: aiohttp.ClientSession, interval_s: float = 1.0) -> None:
    """Interim readiness of static endpoints: /health 200 means ready."""
    timeout = aiohttp.ClientTimeout(total=2)
    while True:
        for endpoint in fleet.endpoints():
            try:
                async with session.get(endpoint.base_url + "/health", timeout=timeout) as response:
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            endpoint.state = EndpointState.READY if ok else EndpointState.UNHEALTHY
        await asyncio.sleep(interval_s)


async def _pipeline_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[appkeys.SETTINGS]
    fleet = app[appkeys.FLEET]
    pipeline = Pipeline(
        server=settings.server,
        policies=app[appkeys.POLICIES],
        fleet=fleet,
        session=app[appkeys.SESSION],
        routers={name: LeastInflightRouter() for name in fleet.pools},
        admission=OpenAdmission(),
    )
    app[appkeys.PIPELINE] = pipeline
    yield

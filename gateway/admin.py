"""The admin API (`/admin/*`, guarded by the admin token): what operators ask a running gateway."""

from __future__ import annotations

import orjson
from aiohttp import web

from backends.status import fleet_status
from gateway import appkeys
from gateway.routes import Handler


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


async def backends(request: web.Request) -> web.Response:
    """Pools and endpoints: state, load, KV usage, restarts, the log tail of failed replicas."""
    stats_max_age_s = request.app[appkeys.BACKENDS].stats_max_age_s
    return _json(fleet_status(request.app[appkeys.FLEET], stats_max_age_s=stats_max_age_s))


async def status(request: web.Request) -> web.Response:
    policies = request.app[appkeys.POLICIES]
    policy = policies.current
    return _json({"policy": {"source": policy.source}})


def admin_routes() -> list[tuple[str, str, Handler]]:
    return [
        ("GET", "/admin/backends", backends),
        ("GET", "/admin/status", status),
    ]

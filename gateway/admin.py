"""The admin API (`/admin/*`, guarded by the admin token): what operators ask a running gateway."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from gateway import appkeys
from gateway.routes import Handler


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


async def backends(request: web.Request) -> web.Response:
    """Pools and endpoints: state, load, KV usage, restarts."""
    fleet = request.app[appkeys.FLEET]
    now = time.monotonic()
    pools = []
    for pool in fleet.pools.values():
        endpoints = []
        for e in pool.endpoints:
            age = e.stats_age_s(now)
            endpoints.append(
                {
                    "id": e.id,
                    "url": e.base_url,
                    "role": e.role.value,
                    "state": e.state.value,
                    "running": e.stats.running,
                    "waiting": e.stats.waiting,
                    "kv_usage_ratio": e.stats.kv_usage_ratio,
                    "stats_age_s": None if age == float("inf") else round(age, 3),
                    "inflight_requests": e.inflight.requests,
                    "inflight_prefill_tokens": e.inflight.prefill_tokens,
                    "inflight_decode_tokens": e.inflight.decode_tokens,
                    "restarts": e.restarts,
                }
            )
        pools.append({"name": pool.name, "model": pool.config.model, "engine": pool.config.engine,
                      "endpoints": endpoints})
    return _json({"pools": pools})


async def status(request: web.Request) -> web.Response:
    policies = request.app[appkeys.POLICIES]
    policy = policies.current
    return _json({"policy": {"source": policy.source}})


def admin_routes() -> list[tuple[str, str, Handler]]:
    return [
        ("GET", "/admin/backends", backends),
        ("GET", "/admin/status", status),
    ]

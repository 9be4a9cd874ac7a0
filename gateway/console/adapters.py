"""`GET /admin/adapters`: the console's adapter view. Per pool that serves the base model of a LoRA
adapter, per replica: the adapters there and how each is known (the engine runs or queues requests
for it, the gateway holds it, the engine lists it), their sizes against the pool's memory budget, and
what the gateway did there since it started (loads on demand, preloads, evictions for the budget,
idle unloads, failed loads).

Read from state the gateway keeps anyway (docs/adapters.md): the engines' `vllm:lora_requests_info`
(`EndpointStats.running_loras`, `waiting_loras`, `max_loras`), their `/v1/models` listing
(`Endpoint.loras`), and the loader's pairs and per-replica counters (`gateway/transport/lora.py`). No
engine is asked: a read costs the gateway a walk of its own tables. The counters of a shared replica
(static or discovered) are every gateway process's when they share adapter state (`state: redis`,
`gateway/transport/lora_shared.py`: running totals since the pool's hash began, as of the last flush,
`counted_by: "fleet"`); otherwise, and for a replica this process launched, this process's own since
it started (`counted_by: "process"`). Which adapters a replica holds is this process's view.
"""

from __future__ import annotations

from aiohttp import web

from backends.fleet import DEFAULT_ADAPTER_BYTES, MB, Fleet, budget_bytes
from backends.scrape import serving_pools
from backends.types import Endpoint
from gateway.app import keys as appkeys
from gateway.http.admin_replies import json_reply
from gateway.transport.lora import AdapterLoader, Held, ReplicaActivity

LORA_LOADER = web.AppKey("lora_loader", AdapterLoader)  # set by the app factory with the engine transport


async def adapters_view(request: web.Request) -> web.Response:
    loader = request.app.get(LORA_LOADER)
    return json_reply(adapter_view(request.app[appkeys.FLEET], loader, loader.clock() if loader else 0.0))


def adapter_view(fleet: Fleet, loader: AdapterLoader | None, now_s: float) -> dict[str, object]:
    """The view's document (see the module's docstring); `now_s` on the loader's clock."""
    pools = []
    for name in sorted(serving_pools(fleet)):
        pool = fleet.pools[name]
        budget = budget_bytes(pool.config.lora_memory_budget_mb)
        adapters = sorted(a.name for a in fleet.adapters.values() if a.base_model == pool.config.model)
        replicas = [_replica(fleet, loader, endpoint, now_s) for endpoint in pool.endpoints]
        pools.append(
            {
                "name": name,
                "model": pool.config.model,
                "adapters": adapters,
                "memory_budget_mb": _mb(budget),
                "replicas": replicas,
            }
        )
    return {"pools": pools}


def _replica(fleet: Fleet, loader: AdapterLoader | None, endpoint: Endpoint, now_s: float) -> dict[str, object]:
    stats = endpoint.stats
    held: dict[str, Held] = {h.adapter: h for h in loader.held_on(endpoint.id)} if loader is not None else {}
    listed = endpoint.loras or frozenset()
    names = sorted(stats.running_loras | stats.waiting_loras | held.keys() | listed)
    rows = []
    used = 0
    for adapter in names:
        policy = fleet.adapter(adapter)
        size = policy.size_bytes if policy is not None and policy.size_bytes else DEFAULT_ADAPTER_BYTES
        registered = adapter in held or adapter in listed
        used += size if registered else 0
        pair = held.get(adapter)
        rows.append(
            {
                "name": adapter,
                "running": adapter in stats.running_loras,
                "waiting": adapter in stats.waiting_loras,
                "held": pair is not None,  # the gateway registered it there, or served it where listed
                "listed": adapter in listed,  # the engine's /v1/models lists it
                "preload": bool(policy is not None and policy.preload),
                "size_mb": _mb(size),
                "inflight": pair.inflight if pair is not None else 0,
                "idle_s": round(max(now_s - pair.last_used_s, 0.0), 1)
                if pair is not None and not pair.inflight
                else None,
            }
        )
    fleet_counts = loader.share.fleet_activity(endpoint) if loader is not None and loader.share is not None else None
    counts = fleet_counts or (loader.activity.get(endpoint.id) if loader is not None else None)
    counts = counts or ReplicaActivity(endpoint.pool)
    return {
        "id": endpoint.id,
        "state": endpoint.state.value,
        "max_loras": stats.max_loras or None,
        "active": sorted(stats.running_loras | stats.waiting_loras),
        "memory_used_mb": _mb(used),
        "adapters": rows,
        "loads": counts.loads,
        "preloads": counts.preloads,
        "evictions": counts.evictions,
        "unloads": counts.unloads,
        "failures": counts.failures,
        "counted_by": "fleet" if fleet_counts is not None else "process",
    }


def _mb(size: int | None) -> float | None:
    return round(size / MB, 3) if size is not None else None

"""The admin API (`/admin/*`, guarded by the admin token): what operators ask a running gateway."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from aiohttp import web

from backends.status import fleet_status
from gateway.app import keys as appkeys
from gateway.audit.api import note
from gateway.autoscale.floor_api import floor_delete, floor_get, floor_put
from gateway.autoscale.wiring import AUTOSCALER
from gateway.http.admin_replies import json_reply
from gateway.http.routes import Handler
from gateway.http.team_scope import TeamView, team_view
from gateway.ledger.reconcile import RECONCILER
from policies.flow import reserve
from policies.flow.saturation import saturation_reasons
from policies.limits.compile import SPEND_RULE_ID


async def backends(request: web.Request) -> web.Response:
    """Pools and endpoints: state, load, KV usage, restarts, the log tail of failed replicas."""
    stats_max_age_s = request.app[appkeys.BACKENDS].stats_max_age_s
    status = fleet_status(request.app[appkeys.FLEET], stats_max_age_s=stats_max_age_s)
    discovery = request.app.get(appkeys.DISCOVERY)
    if discovery is not None:
        status["discovery"] = discovery.status()
    estimator = request.app[appkeys.DIRECTOR].intake.estimator
    for pool in status["pools"]:  # how each pool's prompts are counted, and how often that matched
        pool["tokenizer"] = estimator.describe(pool["model"])
    hub = request.app[appkeys.KV_HUB]
    if hub is not None:  # precise mode: each endpoint's KV-event subscription and what the index holds
        subscriptions = hub.stats()
        index = request.app[appkeys.ROUTER].index.precise
        blocks = index.stats(time.monotonic()) if index is not None else {}
        for pool in status["pools"]:
            for endpoint in pool["endpoints"]:
                sub = subscriptions.get(endpoint["id"])
                if sub is not None:
                    endpoint["kv_events"] = asdict(sub)
                held = blocks.get(endpoint["id"])
                if held is not None:
                    endpoint["precise_index"] = {"blocks": held.blocks, "speculative": held.speculative,
                                                 "alive": held.alive}  # fmt: skip
    return json_reply(status)


async def pools(request: web.Request) -> web.Response:
    """Autoscaled pools: current vs desired replicas per role, the reason, the last decisions and
    actions, learnt start-up times (`?signals=POOL` adds the planner's recorded inputs)."""
    autoscaler = request.app[AUTOSCALER]
    body = autoscaler.status()
    quotas = request.app.get(appkeys.PROVIDER_QUOTAS)
    if quotas is not None:  # hosted pools whose provider said "no more until ..." (transport/provider_quota.py)
        body["provider_quotas"] = quotas.status()
    pool = request.query.get("signals")
    if pool:
        body["signals"] = autoscaler.recorded(pool)
    return json_reply(body)


async def status(request: web.Request) -> web.Response:
    """The running policy (and the last reload error, if any), the limiter store and every bucket;
    to a team admin, its teams' buckets only (`team_status`)."""
    admission = request.app[appkeys.ADMISSION]
    view = team_view(request)
    if view is not None:
        return json_reply(team_status(view, request.app[appkeys.POLICIES].status(), admission))
    return json_reply(
        {
            "policy": request.app[appkeys.POLICIES].status(),
            "admission": admission.status(),
            "limits": admission.snapshot(),
            "flow": flow_status(request.app),
            "spend_reconciliation": _reconciliation(request.app),
        }
    )


TEAM_WITHHELD = ("policy.last_error", "admission.decisions", "admission.shadow_exceeded", "flow",
                 "spend_reconciliation")  # fmt: skip


def team_status(view: TeamView, policy: dict[str, Any], admission: Any) -> dict[str, Any]:
    """`/admin/status` for a team admin: the counters of its teams' keys, tenants and teams; what sums
    or names every team (decision counts, waiting rooms per tenant, spend reconciliation, a rejected
    reload's messages) is withheld (null) rather than split, and `team_scope` says so."""
    store = {k: v for k, v in admission.status().items() if k not in ("decisions", "shadow_exceeded")}
    return {
        "policy": {**policy, "last_error": None, "last_error_at_unix_s": None},
        "admission": store,
        "limits": [row for row in admission.snapshot() if view.sees_counter(row.get("scope"), row.get("subject"))],
        "flow": None,
        "spend_reconciliation": None,
        "team_scope": {"teams": sorted(view.teams), "withheld": list(TEAM_WITHHELD)},
    }


def _reconciliation(app: web.Application) -> dict[str, Any] | None:
    """The last comparison of enforced spend with the ledger (gateway/ledger/reconcile.py); null: off."""
    reconciler = app.get(RECONCILER)
    return reconciler.status() if reconciler is not None else None


def flow_status(app: web.Application) -> dict[str, Any]:
    """Each pool's waiting room (who waits per band and tenant, drain rate, shares, counters),
    why each of its endpoints is saturated now (null: it could start a request) and, with a slot
    reserve, how many slots it keeps now and from what (`reserve.describe`)."""
    queue = app[appkeys.FLOW]
    found = queue.status()
    settings = app[appkeys.FLOW_SETTINGS]
    now_s = time.monotonic()
    for pool in app[appkeys.FLEET].pools.values():
        room = found["pools"].setdefault(pool.name, {"waiting": 0})
        limits = settings.limits(pool.name, pool.config.max_num_seqs)
        room["saturation"] = saturation_reasons(pool.endpoints, limits, now_s)
        size = limits.reserve
        if size.enabled and limits.max_num_seqs:
            free = reserve.free_slots(pool.servable(), limits.max_num_seqs, now_s, limits.max_stats_age_s)
            room["reserve"] = reserve.describe(queue.activity.active(pool.name), size, free)
    return found


async def reload(request: web.Request) -> web.Response:
    """Reload policies.yaml now; 200 with the result, 422 when the file is invalid (old policy stays)."""
    before = request.app[appkeys.POLICIES].generation
    result = await request.app[appkeys.POLICY_WATCHER].reload("admin")
    note(request, target="policies", before={"generation": before}, after=result.as_dict())
    return json_reply(result.as_dict(), status=200 if result.ok else 422)


async def replicas(request: web.Request) -> web.Response:
    """This replica's id, what it published and read, and its peers (age, batches, gaps, load)."""
    bus = request.app[appkeys.REPLICAS]
    return json_reply(bus.status() if bus is not None else {"sharing": False})


def limiter_gauges(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Limiter snapshot rows in the gauges' shape: scope, id, dimension, limit, remaining."""
    out = []
    for row in rows:
        if row.get("rule") == SPEND_RULE_ID:  # a key's spend counter, not a limit
            continue
        if row.get("kind") == "budget":
            dimension = f"usd_per_{row.get('period', '')}"
            limit, remaining = row.get("limit_usd"), row.get("remaining_usd")
        else:
            dimension = str(row.get("dimension", ""))
            limit, remaining = row.get("capacity"), row.get("remaining")
        if row.get("kind") == "concurrency" and limit is not None:
            remaining = max(0.0, float(limit) - float(row.get("active", 0)))
        out.append(
            {
                "scope": row.get("scope", ""),
                "id": row.get("subject", ""),
                "dimension": dimension,
                "limit": limit or 0.0,
                "remaining": remaining or 0.0,
            }
        )
    return out


async def predictor(request: web.Request) -> web.Response:
    """Per pool and target (ttft, tpot): samples, online MAPE, p90 coverage, model age and source."""
    found = request.app[appkeys.PREDICTOR]
    if found is None:
        return json_reply({"enabled": False})
    return json_reply({"enabled": True, **found.status()})


async def predictor_samples(request: web.Request) -> web.Response:
    """The predictor's recent outcomes per pool, in time order (`?pool=` narrows to one), to judge
    features and models offline. Bounded by `predictor.export_samples` per pool."""
    found = request.app[appkeys.PREDICTOR]
    if found is None:
        return json_reply({"enabled": False, "pools": {}})
    return json_reply({"enabled": True, "pools": found.samples(request.query.get("pool"))})


def predictor_gauges(status: dict[str, Any]) -> dict[str, Any]:
    """The predictor's status flattened into the gauges' shape: {"pools": {pool: {field: number}}}."""
    pools: dict[str, dict[str, float]] = {}
    for pool, state in status.get("pools", {}).items():
        fields: dict[str, float] = {"model_version": state.get("model_version", 0)}
        for target, info in (state.get("targets") or {}).items():
            online = info.get("online") or {}
            fields[f"{target}_samples"] = info.get("samples") or 0
            fields[f"{target}_model"] = 1.0 if info.get("source") == "model" else 0.0
            if info.get("model_age_s") is not None:
                fields[f"{target}_model_age_seconds"] = info["model_age_s"]
            if online.get("mape_pct") is not None:  # Prometheus exports ratios (0..1), never percents
                fields[f"{target}_mape_ratio"] = online["mape_pct"] / 100.0
            if online.get("p90_coverage") is not None:
                fields[f"{target}_p90_coverage_ratio"] = online["p90_coverage"]
        pools[pool] = fields
    return {"pools": pools}


def admin_routes() -> list[tuple[str, str, Handler]]:
    return [
        ("GET", "/admin/backends", backends),
        ("GET", "/admin/status", status),
        ("GET", "/admin/predictor", predictor),
        ("GET", "/admin/predictor/samples", predictor_samples),
        ("POST", "/admin/reload", reload),
        ("GET", "/admin/replicas", replicas),
        ("GET", "/admin/pools", pools),
        ("PUT", "/admin/pools/{pool}/floor", floor_put),
        ("GET", "/admin/pools/{pool}/floor", floor_get),
        ("DELETE", "/admin/pools/{pool}/floor", floor_delete),
    ]

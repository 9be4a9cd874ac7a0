"""The admin API (`/admin/*`, guarded by the admin token): what operators ask a running gateway, the
keys and tenants it holds, and the temporary overrides of its limits.

Every handler here answers an operator through the admin guard (`gateway/http/routes.py`), reads or
changes the running gateway's state, and notes each change in the audit log; the sections say why
the keys and the overrides work as they do.

Keys and tenants
----------------

Through the admin API (`/admin/keys`, `/admin/tenants`), and a caller's own
standing (`GET /v1/key`).

Create and rotate return the secret once; nothing else ever does (only its SHA-256 is stored).
Keys and tenants of policies.yaml are listed too, marked `source: file`, and are read-only here:
they change through the file (GitOps) and its hot reload. Errors are in OpenAI's shape like the rest.

`/v1/key` follows OpenRouter's `GET /api/v1/key` (the calling key's limits and usage under the
OpenAI-compatible base URL, so `client.get("/key", cast_to=object)` of the openai client reaches it);
`/key/info` answers the same for tools written against LiteLLM's proxy, which call that path.

Overrides
---------

Temporary overrides of policies.yaml's limits and budgets through the admin API (`/admin/overrides`).

"Raise the team's budget to $500 until Friday" is an operator's everyday request; editing the file
means remembering to edit it back. An override names a rule (its identity, as `/admin/status` and
429 messages show it), a dimension, a value and an end (`until` or `for`), optionally one subject of
the rule (a team, a key, a tag); when it ends, the rule's own value is back by itself. Overrides are
stored with the keys (SQLite, or Redis shared by every replica) and applied by the admission plans
(policies/limits/plan.py), which are rebuilt when one is added, deleted or ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import orjson
import redis
from aiohttp import web

from backends.scrape import fleet_status
from gateway.app import keys as appkeys
from gateway.audit.api import note
from gateway.autoscale.admin import floor_delete, floor_get, floor_put
from gateway.autoscale.wiring import AUTOSCALER
from gateway.errors import GatewayError, error_response
from gateway.http.access import identity_of, team_refusal
from gateway.http.admin_replies import admin_error, json_reply
from gateway.http.routes import Handler
from gateway.http.team_scope import TeamView, key_tenant, team_view, tenant_team
from gateway.ledger.reconcile import RECONCILER
from gateway.request.intake import PROGRAM_HEADER, authenticate
from policies.flow import saturation
from policies.flow.saturation import saturation_reasons
from policies.keys.directory import DirectoryError, KeyDirectory
from policies.keys.records import KeyRecord, TenantRecord
from policies.limits.plan import SPEND_RULE_ID
from policies.limits.standing import key_spend, standing
from policies.policy import Policy
from policies.routing.pipeline import bounded_key
from policies.schema import PRIORITY_VALUES
from policies.types import NO_SUBJECTS, Principal, RequestSubjects

# ---- Status, reads and actions


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
    reserve, how many slots it keeps now and from what (`saturation.describe`)."""
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
            free = saturation.free_slots(pool.servable(), limits.max_num_seqs, now_s, limits.max_stats_age_s)
            room["reserve"] = saturation.describe(queue.activity.active(pool.name), size, free)
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


# ---- Keys and tenants

log = logging.getLogger(__name__)


def _directory(request: web.Request) -> KeyDirectory:
    return request.app[appkeys.DIRECTORY]


def _policy(request: web.Request) -> Policy:
    return request.app[appkeys.POLICIES].current


def _known_models(request: web.Request) -> list[str]:
    return list(request.app[appkeys.FLEET].models)


async def read_body(request: web.Request) -> dict[str, Any]:
    """An admin write's JSON object body ({} when empty); a DirectoryError (400) otherwise."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        found = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DirectoryError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(found, dict):
        raise DirectoryError(400, "expected a JSON object")
    return found


def _rendered(render: Callable[[], dict[str, Any]], record: KeyRecord | TenantRecord) -> dict[str, Any]:
    """A record's view, or when it cannot be rendered (a time no calendar holds, a value JSON cannot
    carry: stored before the API bounded its input) a row flagging it, so that one bad record never
    takes a listing, or the console's page of it, down."""
    try:
        view = render()
        orjson.dumps(view)
        return view
    except Exception as exc:
        name = record.id if isinstance(record, KeyRecord) else record.name
        log.error("stored %s %r cannot be rendered: %s", type(record).__name__, name, exc)
        row: dict[str, Any] = {
            "source": "api",
            "status": "unreadable",
            "error": f"this stored record cannot be shown ({type(exc).__name__}); revoke or rewrite it",
        }
        if isinstance(record, KeyRecord):
            row.update(id=record.id, tenant=record.tenant[:200], revoked=record.revoked_at_unix_s is not None)
        else:
            row.update(name=record.name)
        return row


def _key_view(record: KeyRecord, now_s: float, last_used_unix_s: float | None = None) -> dict[str, Any]:
    return _rendered(lambda: record.view(now_s, last_used_unix_s), record)


def _tenant_view(record: TenantRecord) -> dict[str, Any]:
    return _rendered(record.view, record)


def _guarded(handler: Handler) -> Handler:
    """Directory refusals become their HTTP errors; and a team admin reaches a route naming a key or a
    tenant in its path only when that key's tenant, or that tenant, is of one of its teams (checked
    here, before the handler, for every such route: gateway/http/access.py). What only the body names
    (the tenant of a new key, the team of a new or moved tenant) the handlers check."""

    async def run(request: web.Request) -> web.StreamResponse:
        refusal = _path_team_refusal(request)
        if refusal is not None:
            return error_response(refusal)
        try:
            return await handler(request)
        except DirectoryError as exc:
            return admin_error(exc.status, str(exc), exc.param)

    return run


def _tenant_team(request: web.Request, tenant: str | None) -> str | None:
    """The team of a tenant of policies.yaml or of the admin API (None: no team, or no such tenant)."""
    return tenant_team(_policy(request), _directory(request), tenant)


def _key_tenant(request: web.Request, key_id: str) -> str | None:
    return key_tenant(_policy(request), _directory(request), key_id)


def _in_scope(request: web.Request, tenant: str | None) -> bool:
    scope = identity_of(request).team_scope
    return scope is None or _tenant_team(request, tenant) in scope


def _path_team_refusal(request: web.Request) -> GatewayError | None:
    """A team admin's refusal for a key or tenant of another team named in the path. An unknown one
    is refused too (403, not 404: a team admin learns nothing of other teams' names)."""
    if identity_of(request).team_scope is None:
        return None
    if "key_id" in request.match_info:
        key_id = request.match_info["key_id"]
        tenant = _key_tenant(request, key_id)
        return team_refusal(request, _tenant_team(request, tenant), f"key {key_id!r}")
    if "name" in request.match_info:
        name = request.match_info["name"]
        return team_refusal(request, _tenant_team(request, name), f"tenant {name!r}")
    return None


# ---------------------------------------------------------------------- keys
async def keys_create(request: web.Request) -> web.StreamResponse:
    directory = _directory(request)
    payload = await read_body(request)
    tenant = payload.get("tenant") if isinstance(payload.get("tenant"), str) else None
    refusal = team_refusal(request, _tenant_team(request, tenant), f"tenant {tenant!r}")
    if refusal is not None:
        return error_response(refusal)
    record, secret = await directory.create_key(payload, _policy(request), _known_models(request))
    view = _key_view(record, time.time())
    note(request, target=record.id, after=view)
    return json_reply({"key": view, "secret": secret, "note": "the secret is shown once; store it now"}, status=201)


async def keys_list(request: web.Request) -> web.StreamResponse:
    directory = _directory(request)
    policy = _policy(request)
    tenant = request.query.get("tenant")
    include_revoked = request.query.get("include_revoked") in ("1", "true", "yes")
    now_s = time.time()
    rows = [
        _file_key_view(k.id, k.tenant, k.models, k.priority, k.disabled)
        for k in policy.config.keys
        if (tenant is None or k.tenant == tenant) and _in_scope(request, k.tenant)
    ]
    for record in directory.keys.values():
        if tenant is not None and record.tenant != tenant:
            continue
        if not _in_scope(request, record.tenant):  # a team admin sees its teams' keys only
            continue
        if record.revoked_at_unix_s is not None and not include_revoked:
            continue
        rows.append(_key_view(record, now_s, directory.last_use_of(record.id)))
    for row in rows:
        row["team"] = _tenant_team(request, row.get("tenant"))
    if _wants_spend(request):
        await _add_spend(request, policy, rows)
    return json_reply({"object": "list", "data": rows})


MAX_SPEND_ROWS = 5000  # a listing reads at most this many keys' spend counters (the rest: spend_usd null)
SPEND_BATCH = 200  # peeks in flight at once (the Redis store pipelines them)


def _wants_spend(request: web.Request) -> bool:
    return request.query.get("spend") in ("1", "true", "yes")


async def _add_spend(request: web.Request, policy: Policy, rows: list[dict[str, Any]]) -> None:
    """`spend_usd: {day, month}` on each key row: one peek of the key's spend counters per key (not a
    standing per model), at most `MAX_SPEND_ROWS` keys, `SPEND_BATCH` at a time; only when asked
    (`?spend=1`), so a plain listing reads nothing from the store. A revoked, expired or unreadable
    key's row has none."""
    directory = _directory(request)
    store = request.app[appkeys.ADMISSION].store
    models = _known_models(request)
    wanted: list[tuple[dict[str, Any], Principal]] = []
    for row in rows:
        row["spend_usd"] = None
        if row.get("status") != "active" or len(wanted) >= MAX_SPEND_ROWS:
            continue
        key_id = str(row.get("id"))
        principal = (
            policy.file_principal(key_id) if row.get("source") == "file" else directory.principal(key_id, policy)
        )
        if principal is not None:
            wanted.append((row, principal))
    for start in range(0, len(wanted), SPEND_BATCH):
        batch = wanted[start : start + SPEND_BATCH]
        found = await asyncio.gather(*(key_spend(store, policy, p, models) for _, p in batch))  # type: ignore[arg-type]
        for (row, _), spend in zip(batch, found, strict=True):
            row["spend_usd"] = spend


async def keys_show(request: web.Request) -> web.StreamResponse:
    key_id = request.match_info["key_id"]
    directory = _directory(request)
    policy = _policy(request)
    record = directory.keys.get(key_id)
    if record is not None:
        view = _key_view(record, time.time(), directory.last_use_of(key_id))
        principal = directory.principal(key_id, policy)
    else:
        file_key = next((k for k in policy.config.keys if k.id == key_id), None)
        if file_key is None:
            return admin_error(404, f"no key {key_id!r}", "id")
        view = _file_key_view(file_key.id, file_key.tenant, file_key.models, file_key.priority, file_key.disabled)
        principal = policy.file_principal(key_id)
    if principal is not None and view.get("status") == "active":
        view["standing"] = await _standing(request, policy, principal)
    return json_reply(view)


async def keys_patch(request: web.Request) -> web.StreamResponse:
    key_id = request.match_info["key_id"]
    if _is_file_key(request, key_id):
        return admin_error(409, f"key {key_id!r} is defined in policies.yaml: change it there", "id")
    before = _stored_key_view(request, key_id)
    record = await _directory(request).patch_key(
        key_id, await read_body(request), _policy(request), _known_models(request)
    )
    view = _key_view(record, time.time(), _directory(request).last_use_of(key_id))
    note(request, target=key_id, before=before, after=view)
    return json_reply(view)


async def keys_revoke(request: web.Request) -> web.StreamResponse:
    key_id = request.match_info["key_id"]
    if _is_file_key(request, key_id):
        return admin_error(
            409, f"key {key_id!r} is defined in policies.yaml: remove it there (or set disabled: true)", "id"
        )
    before = _stored_key_view(request, key_id)
    record = await _directory(request).revoke_key(key_id)
    view = _key_view(record, time.time())
    note(request, target=key_id, before=before, after=view)
    return json_reply({"id": key_id, "revoked": True, "key": view})


async def keys_rotate(request: web.Request) -> web.StreamResponse:
    key_id = request.match_info["key_id"]
    if _is_file_key(request, key_id):
        return admin_error(409, f"key {key_id!r} is defined in policies.yaml: rotate it there", "id")
    before = _stored_key_view(request, key_id)
    record, secret = await _directory(request).rotate_key(key_id, await read_body(request))
    view = _key_view(record, time.time())
    note(request, target=key_id, before=before, after=view)
    return json_reply({"key": view, "secret": secret, "note": "the secret is shown once; store it now"})


def _stored_key_view(request: web.Request, key_id: str) -> dict[str, Any] | None:
    """A stored key's view before a change, for the change's audit record (never its secret)."""
    record = _directory(request).keys.get(key_id)
    return _key_view(record, time.time()) if record is not None else None


def _is_file_key(request: web.Request, key_id: str) -> bool:
    return any(k.id == key_id for k in _policy(request).config.keys)


def _file_key_view(
    key_id: str, tenant: str, models: list[str] | None, priority: str | None, disabled: bool
) -> dict[str, Any]:
    return {
        "id": key_id,
        "source": "file",
        "tenant": tenant,
        "status": "disabled" if disabled else "active",
        "models": models,
        "priority": priority,
        "limits": {},
        "metadata": {},
    }


# ---------------------------------------------------------------------- tenants
async def tenants_create(request: web.Request) -> web.StreamResponse:
    payload = await read_body(request)
    team = payload.get("team") if isinstance(payload.get("team"), str) else None
    refusal = team_refusal(request, team, "a new tenant")  # a team admin's new tenant is of its team
    if refusal is not None:
        return error_response(refusal)
    record = await _directory(request).create_tenant(payload, _policy(request), _known_models(request))
    view = _tenant_view(record)
    note(request, target=record.name, after=view)
    return json_reply(view, status=201)


async def tenants_list(request: web.Request) -> web.StreamResponse:
    policy = _policy(request)
    rows = [_file_tenant_view(name, policy) for name in policy.config.tenants if _in_scope(request, name)]
    rows += [_tenant_view(r) for r in _directory(request).tenants.values() if _in_scope(request, r.name)]
    if _wants_spend(request):
        await _add_tenant_spend(request, policy, rows)
    return json_reply({"object": "list", "data": rows})


async def _add_tenant_spend(request: web.Request, policy: Policy, rows: list[dict[str, Any]]) -> None:
    """`spend_usd: {day, month}` per tenant, and `spend_source` saying from what: the tenant's own
    figure from the ledger (gateway/console/tenant_spend.py: no counter added to admission, a scan
    shared for a few seconds) when the ledger is on and readable, else the sum of its keys' counters."""
    names = {str(row.get("name")) for row in rows}
    spend = request.app.get(appkeys.TENANT_SPEND)
    if spend is not None:
        try:
            found, about = await spend.of(names)
        except (OSError, ValueError, redis.RedisError) as exc:  # stream unreachable or unreadable: keys
            log.warning("tenant spend from the ledger unavailable: %s", exc)
        else:
            for row in rows:
                row["spend_usd"] = found[str(row.get("name"))]
                row["spend_source"] = about
            return
    await _add_key_sum_spend(request, policy, rows, names)
    for row in rows:
        row["spend_source"] = {"source": "keys"}


async def _add_key_sum_spend(request: web.Request, policy: Policy, rows: list[dict[str, Any]], names: set[str]) -> None:
    """`spend_usd` per tenant as the sum of its active keys' counters (the same batched peeks as the
    key list), when there is no ledger to read: a key with no counter (a file key without
    `admission.track_key_spend`) adds nothing."""
    keys: list[dict[str, Any]] = [
        _file_key_view(k.id, k.tenant, k.models, k.priority, k.disabled)
        for k in policy.config.keys
        if k.tenant in names
    ]
    now_s = time.time()
    keys += [_key_view(r, now_s) for r in _directory(request).keys.values() if r.tenant in names]
    await _add_spend(request, policy, keys)
    totals: dict[str, dict[str, float | None]] = {name: {"day": None, "month": None} for name in names}
    for key in keys:
        spend = key.get("spend_usd") or {}
        total = totals[str(key["tenant"])]
        for period in ("day", "month"):
            value = spend.get(period)
            if value is not None:
                total[period] = round((total[period] or 0.0) + value, 6)
    for row in rows:
        row["spend_usd"] = totals[str(row.get("name"))]


async def tenants_show(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    policy = _policy(request)
    directory = _directory(request)
    if name in policy.config.tenants:
        view = _file_tenant_view(name, policy)
    elif name in directory.tenants:
        view = _tenant_view(directory.tenants[name])
    else:
        return admin_error(404, f"no tenant {name!r}", "name")
    view["keys"] = sorted(
        [k.id for k in policy.config.keys if k.tenant == name]
        + [r.id for r in directory.keys.values() if r.tenant == name and r.revoked_at_unix_s is None]
    )
    return json_reply(view)


async def tenants_patch(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name in _policy(request).config.tenants:
        return admin_error(409, f"tenant {name!r} is defined in policies.yaml: change it there", "name")
    found = _directory(request).tenants.get(name)
    before = _tenant_view(found) if found is not None else None
    payload = await read_body(request)
    if "team" in payload:  # a team admin moves a tenant only to another of its teams
        team = payload["team"] if isinstance(payload["team"], str) else None
        refusal = team_refusal(request, team, f"tenant {name!r} moved to it")
        if refusal is not None:
            return error_response(refusal)
    record = await _directory(request).patch_tenant(name, payload, _policy(request), _known_models(request))
    view = _tenant_view(record)
    note(request, target=name, before=before, after=view)
    return json_reply(view)


async def tenants_delete(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name in _policy(request).config.tenants:
        return admin_error(409, f"tenant {name!r} is defined in policies.yaml: remove it there", "name")
    found = _directory(request).tenants.get(name)
    await _directory(request).delete_tenant(name)
    note(request, target=name, before=_tenant_view(found) if found is not None else None)
    return json_reply({"name": name, "deleted": True})


def _file_tenant_view(name: str, policy: Policy) -> dict[str, Any]:
    tenant = policy.config.tenants[name]
    return {
        "name": name,
        "source": "file",
        "models": tenant.models,
        "priority": tenant.priority,
        "allow_fallback": tenant.allow_fallback,
        "slo_class": tenant.slo_class,
        "team": tenant.team,
        "limits": {},
        "metadata": {},
    }


# ---------------------------------------------------------------------- the caller's own standing
async def _standing(
    request: web.Request, policy: Policy, principal: Principal, subjects: RequestSubjects = NO_SUBJECTS
) -> dict[str, Any]:
    admission = request.app[appkeys.ADMISSION]
    models = request.app[appkeys.FLEET].models
    return await standing(admission.store, policy, principal, models, subjects)  # type: ignore[arg-type]


async def own_key(request: web.Request) -> web.StreamResponse:
    """The calling key's limits, remaining in each bucket, spend this day and month, budget left."""
    policy = request.app[appkeys.POLICIES].current
    try:
        principal = authenticate(request, policy)
    except GatewayError as error:
        return error_response(error)
    data: dict[str, Any] = {
        "key_id": principal.key_id,
        "tenant": principal.tenant,
        "source": principal.source,
        "models": sorted(principal.allowed_models) if principal.allowed_models is not None else None,
        "priority": next((n for n, v in PRIORITY_VALUES.items() if v == principal.priority), str(principal.priority)),
    }
    directory = request.app[appkeys.DIRECTORY]
    record = directory.keys.get(principal.key_id) if principal.source == "api" else None
    if record is not None:
        data["expires_at"] = _key_view(record, time.time()).get("expires_at")
        data["hint"] = record.hint
    # `?program=` (or the program header): that agent run's caps and what it spent (docs/agents.md)
    named = request.query.get("program") or request.headers.get(PROGRAM_HEADER)
    program = bounded_key(named) if named else None
    if program is not None:
        data["program"] = program
    data.update(await _standing(request, policy, principal, RequestSubjects(program=program)))
    if program is not None:
        await _add_program_spend(request, principal.tenant, program, data)
    return json_reply({"data": data})


async def _add_program_spend(request: web.Request, tenant: str, program: str, data: dict[str, Any]) -> None:
    """`program_spend`: the run's calls, tokens and dollars this month from the ledger, whether or not
    a run rule counts it (gateway/console/tenant_spend.py; the caps above are the counters' own)."""
    spend = request.app.get(appkeys.TENANT_SPEND)
    if spend is None:
        return
    try:
        run, about = await spend.run(tenant, program)
    except (OSError, ValueError, redis.RedisError) as exc:  # stream unreachable or unreadable
        log.warning("agent run spend from the ledger unavailable: %s", exc)
        return
    figures: dict[str, Any] = {"calls": 0, "tokens": 0, "usd": 0.0, "started_at": None, "last_call_at": None}
    if run is not None:
        figures = {
            "calls": run.calls,
            "tokens": run.tokens,
            "usd": round(run.usd, 6),
            "started_at": round(run.first_s, 3),
            "last_call_at": round(run.last_s, 3),
        }
    data["program_spend"] = {**figures, **about}


def key_routes() -> list[tuple[str, str, Handler]]:
    """Admin routes (guarded by the admin token where they are mounted)."""
    routes: list[tuple[str, str, Handler]] = [
        ("POST", "/admin/keys", keys_create),
        ("GET", "/admin/keys", keys_list),
        ("GET", "/admin/keys/{key_id}", keys_show),
        ("PATCH", "/admin/keys/{key_id}", keys_patch),
        ("DELETE", "/admin/keys/{key_id}", keys_revoke),
        ("POST", "/admin/keys/{key_id}/rotate", keys_rotate),
        ("POST", "/admin/tenants", tenants_create),
        ("GET", "/admin/tenants", tenants_list),
        ("GET", "/admin/tenants/{name}", tenants_show),
        ("PATCH", "/admin/tenants/{name}", tenants_patch),
        ("DELETE", "/admin/tenants/{name}", tenants_delete),
    ]
    return [(method, path, _guarded(handler)) for method, path, handler in routes]


# ---- Overrides


async def overrides_list(request: web.Request) -> web.StreamResponse:
    directory = request.app[appkeys.DIRECTORY]
    now_s = time.time()
    include_ended = request.query.get("include_ended") in ("1", "true", "yes")
    rows = [o.view(now_s) for o in directory.overrides.values() if include_ended or o.until_unix_s > now_s]
    view = team_view(request)
    if view is not None:  # a team admin: overrides of its teams' keys, tenants and teams only
        rows = [row for row in rows if view.sees_override(row)]
    rows.sort(key=lambda row: (row["until"], row["id"]))
    return json_reply({"object": "list", "data": rows})


async def overrides_create(request: web.Request) -> web.StreamResponse:
    directory = request.app[appkeys.DIRECTORY]
    try:
        record = await directory.create_override(await read_body(request), request.app[appkeys.POLICIES].current)
    except DirectoryError as error:
        return admin_error(error.status, str(error), error.param)
    view = record.view(time.time())
    note(request, target=record.id, after=view)
    return json_reply(view, status=201)


async def overrides_delete(request: web.Request) -> web.StreamResponse:
    override_id = request.match_info["override_id"]
    try:
        record = await request.app[appkeys.DIRECTORY].delete_override(override_id)
    except DirectoryError as error:
        return admin_error(error.status, str(error), error.param)
    note(request, target=override_id, before=record.view(time.time()))
    return json_reply({"id": override_id, "deleted": True})


def override_routes() -> list[tuple[str, str, Handler]]:
    """Admin routes (guarded by the admin token where they are mounted)."""
    return [
        ("GET", "/admin/overrides", overrides_list),
        ("POST", "/admin/overrides", overrides_create),
        ("DELETE", "/admin/overrides/{override_id}", overrides_delete),
    ]

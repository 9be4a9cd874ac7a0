"""Keys and tenants through the admin API (`/admin/keys`, `/admin/tenants`), and a caller's own
standing (`GET /v1/key`).

Create and rotate return the secret once; nothing else ever does (only its SHA-256 is stored).
Keys and tenants of policies.yaml are listed too, marked `source: file`, and are read-only here:
they change through the file (GitOps) and its hot reload. Errors are in OpenAI's shape like the rest.

`/v1/key` follows OpenRouter's `GET /api/v1/key` (the calling key's limits and usage under the
OpenAI-compatible base URL, so `client.get("/key", cast_to=object)` of the openai client reaches it);
`/key/info` answers the same for tools written against LiteLLM's proxy, which call that path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
import redis
from aiohttp import web

from gateway.app import keys as appkeys
from gateway.audit.api import note
from gateway.errors import GatewayError, error_response
from gateway.http.admin_replies import admin_error, json_reply
from gateway.http.roles import identity_of, team_refusal
from gateway.http.routes import Handler
from gateway.http.team_scope import key_tenant, tenant_team
from gateway.request.intake import authenticate
from gateway.request.program import PROGRAM_HEADER
from policies.keys.directory import DirectoryError, KeyDirectory
from policies.keys.records import KeyRecord, TenantRecord
from policies.limits.standing import key_spend, standing
from policies.policy import Policy
from policies.routing.session import bounded_key
from policies.schema import PRIORITY_VALUES
from policies.types import NO_SUBJECTS, Principal, RequestSubjects

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
    here, before the handler, for every such route: gateway/http/roles.py). What only the body names
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
    return json_reply({"data": data})


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

"""HTTP routes: the OpenAI surface, health and readiness, metrics, and the admin API."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.app import keys as appkeys
from gateway.audit.api import record_change
from gateway.console.sessions import COOKIE as CONSOLE_COOKIE
from gateway.errors import GatewayError, InvalidApiKey, error_response
from gateway.http import access, roles
from gateway.http.admin_replies import json_reply
from gateway.http.landing import setup_landing_routes
from gateway.request.apis import APIS
from gateway.request.intake import authenticate
from policies.types import ApiKind

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
METRICS_RENDER: web.AppKey[Callable[[], bytes]] = web.AppKey("metrics_render", object)  # type: ignore[arg-type]
START_TIME: web.AppKey[float] = web.AppKey("start_time", float)
METRICS_TOKEN: web.AppKey[str | None] = web.AppKey("metrics_token", object)  # type: ignore[arg-type]
# A worker of a group (gateway/workers) answers /metrics for the whole group: its siblings' merged in
METRICS_GROUP: web.AppKey[Callable[[], Awaitable[bytes]]] = web.AppKey("metrics_group", object)  # type: ignore[arg-type]


def inference(kind: ApiKind) -> Handler:
    api = APIS[kind]  # looked up once, not per request

    async def handler(request: web.Request) -> web.StreamResponse:
        return await request.app[appkeys.DIRECTOR].handle(request, api)

    return handler


async def list_models(request: web.Request) -> web.Response:
    """Models the calling key may use, in OpenAI's list shape (public names and their aliases)."""
    policy = request.app[appkeys.POLICIES].current
    try:
        principal = authenticate(request, policy)
    except GatewayError as error:
        return error_response(error)
    names: list[str] = []
    for model in request.app[appkeys.FLEET].models:
        config = policy.model_config(model)
        for name in [model, *(config.aliases if config else ())]:
            if (principal.may_use(model) or principal.may_use(name)) and name not in names:
                names.append(name)
    created = int(request.app[START_TIME])
    data = [{"id": n, "object": "model", "created": created, "owned_by": "tokenway"} for n in names]
    return json_reply({"object": "list", "data": data})


async def healthz(request: web.Request) -> web.Response:
    return json_reply({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """200 when the pools `server.ready_when` names have a ready endpoint (every pool, the default
    pool, or any one) or, autoscaled, can start one on demand; the body lists each pool's readiness
    and those that are not ready."""
    fleet = request.app[appkeys.FLEET]
    server = request.app[appkeys.SETTINGS].server
    pools = {name: pool.can_serve for name, pool in fleet.pools.items()}
    not_ready = sorted(name for name, ready in pools.items() if not ready)
    ready = ready_by_rule(pools, server.ready_when, server.default_pool)
    body = {"ready": ready, "ready_when": server.ready_when, "pools": pools, "not_ready": not_ready}
    return json_reply(body, status=200 if ready else 503)


def ready_by_rule(pools: dict[str, bool], rule: str, default_pool: str | None) -> bool:
    """Readiness of the gateway from its pools' (in configuration order) under `ready_when`."""
    if not pools:
        return True
    if rule == "any_pool":
        return any(pools.values())
    if rule == "default_pool":
        name = default_pool if default_pool is not None else next(iter(pools))
        return pools.get(name, False)
    return all(pools.values())


async def metrics(request: web.Request) -> web.Response:
    token = request.app[METRICS_TOKEN]
    if token and not access.token_matches(request.headers, token):
        return error_response(InvalidApiKey("metrics token required (telemetry.metrics.token)"))
    group = request.app.get(METRICS_GROUP)
    body = await group() if group is not None else request.app[METRICS_RENDER]()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def caller_of(request: web.Request) -> access.Caller:
    """The parts of an aiohttp request the access checks read; the port is the one the connection
    reached (the listening socket's), so a `Host` naming another local port is not this gateway."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    port = sockname[1] if isinstance(sockname, tuple) and len(sockname) >= 2 else None
    return access.Caller(request.method, request.headers, request.remote, port, request.secure)


USERS: web.AppKey[roles.Users] = web.AppKey("users", roles.Users)


def gate_of(app: web.Application) -> access.Gate:
    server = app[appkeys.SETTINGS].server
    users = app.get(USERS)
    if users is None:  # built once per app from server.users (a frozen app cannot take it later)
        users = roles.Users.of(server.users)
    return access.Gate(server.admin_token, tuple(server.allowed_hosts), users)


def admin_guard(handler: Handler) -> Handler:
    """Admin routes need the admin token, a user's token (`server.users`) or a console session cookie
    (whose state-changing calls must also carry the session's CSRF token); without a token configured,
    only direct loopback callers naming the gateway in `Host` get in; state-changing calls from another
    site's page never do (gateway/http/access.py). The caller's role must then allow the route
    (`roles.ROUTE_NEEDS`; an undeclared route is admin-only), else 403. Each admitted change that
    succeeds is recorded in the audit log, who, when, what, before and after, durably before its
    answer leaves (gateway/audit)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        sessions = request.app.get(appkeys.CONSOLE_SESSIONS)
        cookie = request.cookies.get(CONSOLE_COOKIE)
        session = sessions.session_of(cookie) if sessions is not None else None
        found = access.admin_identity(caller_of(request), gate_of(request.app), session)
        if isinstance(found, GatewayError):
            return error_response(found)
        resource = request.match_info.route.resource
        refusal = roles.role_refusal(found, request.method, resource.canonical if resource is not None else "")
        if refusal is not None:
            return error_response(refusal)
        request[roles.IDENTITY] = found
        if request.method.upper() in access.SAFE_METHODS:
            return await handler(request)
        # every admitted change is recorded here, so no admin route can forget to (gateway/audit)
        return await record_change(request, handler, found.actor, cookie)

    return guarded


def setup_routes(app: web.Application, admin: list[tuple[str, str, Handler]]) -> None:
    app.router.add_post("/v1/chat/completions", inference("chat"))
    app.router.add_post("/v1/completions", inference("completions"))
    app.router.add_post("/v1/embeddings", inference("embeddings"))
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    setup_landing_routes(app)  # GET / and GET /v1: what answers here, and links (gateway/http/landing.py)
    app[START_TIME] = time.time()
    settings = app.get(appkeys.SETTINGS)
    app[USERS] = roles.Users.of(settings.server.users if settings is not None else ())
    for method, path, handler in admin:
        app.router.add_route(method, path, admin_guard(handler))

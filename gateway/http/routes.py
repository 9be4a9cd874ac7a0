"""HTTP routes: the OpenAI surface, health and readiness, metrics, the admin API, and the landing page.

The route table of `tokenway serve` is set up here, in one place, with the guard every admin route
is mounted through; the landing page (`GET /`, `GET /v1`) is the table's front door.

The landing page
----------------

`GET /` and `GET /v1`: a small page saying what answers here and where to go next.

A new operator's first request is often the base URL itself, in a browser or with curl; a 404 there
reads as "the gateway is broken". The page names the gateway and its version, and links the console,
the metrics, the OpenAPI document, health and readiness, and says where the documentation lives. It
is the same for every gateway (no configuration, no secret, no per-request work: the bytes are built
once), so it is served without credentials, like `/openapi.json`. `LINKS` is also what the start-up
banner prints (gateway/app/server.py).
"""

from __future__ import annotations

import html
import time
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Final

from aiohttp import web

from gateway import __version__
from gateway.app import keys as appkeys
from gateway.audit.api import record_change
from gateway.console.sessions import COOKIE as CONSOLE_COOKIE
from gateway.errors import GatewayError, InvalidApiKey, error_response
from gateway.http import access
from gateway.http.admin_replies import json_reply
from gateway.request.apis import APIS
from gateway.request.intake import authenticate
from policies.types import ApiKind

# ---- The route table

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


USERS: web.AppKey[access.Users] = web.AppKey("users", access.Users)


def gate_of(app: web.Application) -> access.Gate:
    server = app[appkeys.SETTINGS].server
    users = app.get(USERS)
    if users is None:  # built once per app from server.users (a frozen app cannot take it later)
        users = access.Users.of(server.users)
    return access.Gate(server.admin_token, tuple(server.allowed_hosts), users)


def admin_guard(handler: Handler) -> Handler:
    """Admin routes need the admin token, a user's token (`server.users`) or a console session cookie
    (whose state-changing calls must also carry the session's CSRF token); without a token configured,
    only direct loopback callers naming the gateway in `Host` get in; state-changing calls from another
    site's page never do (gateway/http/access.py). The caller's role must then allow the route
    (`access.ROUTE_NEEDS`; an undeclared route is admin-only), else 403. Each admitted change that
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
        refusal = access.role_refusal(found, request.method, resource.canonical if resource is not None else "")
        if refusal is not None:
            return error_response(refusal)
        request[access.IDENTITY] = found
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
    setup_landing_routes(app)  # GET / and GET /v1: what answers here, and links (gateway/http/routes.py)
    app[START_TIME] = time.time()
    settings = app.get(appkeys.SETTINGS)
    app[USERS] = access.Users.of(settings.server.users if settings is not None else ())
    for method, path, handler in admin:
        app.router.add_route(method, path, admin_guard(handler))


# ---- The landing page

LANDING_PATHS: Final = ("/", "/v1")
# (path, what it is): the banner prints these, the page links them
LINKS: Final = (
    ("/ui", "the web console (the admin token)"),
    ("/metrics", "Prometheus metrics"),
    ("/openapi.json", "every route of this gateway, its body and who may call it (OpenAPI 3.1)"),
    ("/v1/models", "the models your key may use (an API key)"),
    ("/healthz", "the process is alive"),
    ("/readyz", "the pools can serve"),
)
DOCS: Final = "README.md and docs/ in tokenway's source (docs/apis.md: the APIs; docs/operations.md: running it)"
# the page has no script, style sheet or form: nothing may run, load or be framed
HEADERS: Final = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def page() -> bytes:
    """The page's bytes (built once; the same for every gateway and request)."""
    items = "\n".join(
        f'    <li><a href="{html.escape(path)}"><code>{html.escape(path)}</code></a> — {html.escape(what)}</li>'
        for path, what in LINKS
    )
    return f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>tokenway {html.escape(__version__)}</title>
  <style>body {{ font: 15px/1.5 system-ui, sans-serif; max-width: 46em; margin: 2em auto; padding: 0 1em; }}</style>
</head>
<body>
  <h1>tokenway {html.escape(__version__)}</h1>
  <p>A token-aware LLM API gateway. Point an OpenAI client's <code>base_url</code> (or an Anthropic
  client's) at <code>/v1</code> of this address, with an API key as the bearer token.</p>
  <ul>
{items}
  </ul>
  <p>Documentation: {html.escape(DOCS)}.</p>
</body>
</html>
""".encode()


async def landing(request: web.Request) -> web.Response:
    """`GET /`, `GET /v1`: the landing page, no credentials needed."""
    return web.Response(body=page(), headers={**HEADERS, "Content-Type": "text/html; charset=utf-8"})


def setup_landing_routes(app: web.Application) -> None:
    for path in LANDING_PATHS:
        app.router.add_get(path, landing)

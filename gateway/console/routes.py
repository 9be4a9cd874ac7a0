"""The console's routes: its static pages (/ui), login and logout, and the two admin reads only the
console needs (/admin/activity, /admin/usage); everything else it shows comes from the admin API.

Pages are committed files served as they are (no build step). Every page response forbids framing
and inline scripts (Content-Security-Policy), so a stored string rendered by mistake cannot run.
"""

from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis
from aiohttp import web

from gateway.app import keys as appkeys
from gateway.console.activity import team_overview
from gateway.console.adapters import adapters_view
from gateway.console.check import model_check
from gateway.console.programs import programs
from gateway.console.sessions import (
    CALLBACK_PATH,
    COOKIE,
    FLOW_COOKIE,
    PENDING_TTL_S,
    ConsoleSessions,
    LoginThrottle,
    OidcBadRequest,
    OidcClient,
    OidcNotConfigured,
    OidcRefused,
    identity_of_claims,
    printable,
    redirect_uri_of,
    retry_after_header,
)
from gateway.console.usage import MAX_CSV_ROWS, MAX_GROUPS, csv_response, usage_async
from gateway.errors import GatewayError, InvalidApiKey, error_response
from gateway.http import access
from gateway.http.access import CONSOLE, Identity
from gateway.http.admin_replies import json_reply
from gateway.http.routes import Handler, caller_of, gate_of
from gateway.http.team_scope import TeamView, team_view
from gateway.ledger.report import ReportError

audit = logging.getLogger("tokenway.audit")

STATIC = Path(__file__).parent / "static"
ASSETS = {
    "console.js": "text/javascript",
    "console.css": "text/css",
    "uplot.iife.min.js": "text/javascript",
    "uplot.min.css": "text/css",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
NO_STORE = {"Cache-Control": "no-store"}  # answers that carry a session's CSRF token


def console_guard(handler: Handler) -> Handler:
    """Every console route first passes the checks that need no credential: the `Host` (and `Origin`)
    name this gateway, and a state-changing request comes from no other site's page."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        refusal = access.surface_refusal(caller_of(request), gate_of(request.app))
        if refusal is not None:
            return error_response(refusal)
        return await handler(request)

    return guarded


async def index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html", headers={**SECURITY_HEADERS, "Content-Type": "text/html"})


async def asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    kind = ASSETS.get(name)
    if kind is None:
        raise web.HTTPNotFound()
    return web.FileResponse(STATIC / name, headers={**SECURITY_HEADERS, "Content-Type": kind})


async def session(request: web.Request) -> web.Response:
    """Whether this browser is logged in (with its session's CSRF token, which only a page of this
    origin can read), and whether logging in needs the admin token."""
    gate = gate_of(request.app)
    caller = caller_of(request)
    found = request.app[appkeys.CONSOLE_SESSIONS].session_of(request.cookies.get(COOKIE))
    if found is not None and not gate.admin_token and not access.direct_loopback(caller):
        found = None  # the cookie does not stand in for loopback trust
    body: dict[str, object] = {
        "authenticated": found is not None,
        "token_required": bool(gate.admin_token),
        "loopback_only": not gate.admin_token,
        "oidc": oidc.label if (oidc := request.app[appkeys.SETTINGS].server.oidc) is not None else None,
    }
    if found is not None:
        body["csrf_token"] = found[0]
        body["identity"] = found[1].view()  # the page hides what this role may not do
    return json_reply(body, headers=NO_STORE)


def login_handler(throttle: LoginThrottle) -> Handler:
    async def login(request: web.Request) -> web.StreamResponse:
        """The admin token, or a user's token (`server.users`: the session gets that user's role), in
        the body (never the URL) for a session cookie and its CSRF token.

        Without an admin token only a direct loopback caller logs in (any token); with one, a wrong
        or missing token is a failure: logged (never its text), counted, and after a few, answered
        429 with `Retry-After` until the backoff has passed (gateway/console/sessions.py)."""
        gate = gate_of(request.app)
        caller = caller_of(request)
        client = caller.remote or "local"
        if not gate.admin_token and not access.direct_loopback(caller):
            return error_response(
                access.LoopbackOnly("the console is loopback-only without server.admin_token (and not through a proxy)")
            )
        wait_s = throttle.retry_after_s(client)
        if wait_s > 0:
            return error_response(LoginThrottled(wait_s))
        try:
            body = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            body = {}
        presented = body.get("token") if isinstance(body, dict) else None
        given = presented.encode("utf-8", "surrogateescape") if isinstance(presented, str) else b""
        identity = gate.users.by_token(given) or CONSOLE  # a user's token logs in as that user
        if gate.admin_token and identity is CONSOLE and not _is_admin_token(given, gate.admin_token):
            failures, wait_s = throttle.failed(client)
            audit.warning(
                "console login failed: wrong admin token from %s (%d recent failures; next try in %.0f s)",
                client, failures, wait_s,
            )  # fmt: skip
            return error_response(InvalidApiKey("wrong admin token"))
        throttle.succeeded(client)
        return open_session(request, identity, client)

    return login


def _is_admin_token(given: bytes, admin_token: str) -> bool:
    return bool(given) and hmac.compare_digest(given, admin_token.encode("utf-8"))


def open_session(request: web.Request, identity: Identity, client: str) -> web.Response:
    """A console session for `identity`: the cookie, and the CSRF token and identity in the body."""
    sessions: ConsoleSessions = request.app[appkeys.CONSOLE_SESSIONS]
    cookie, csrf = sessions.open(identity)
    audit.info("console login of %s (%s) from %s", identity.actor, identity.role, client)
    body = {"authenticated": True, "csrf_token": csrf, "identity": identity.view()}
    response = json_reply(body, headers=NO_STORE)
    response.set_cookie(
        COOKIE,
        cookie,
        max_age=int(sessions.ttl_s),
        path="/",
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )
    return response


class LoginThrottled(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "login_throttled"

    def __init__(self, wait_s: float) -> None:
        retry = retry_after_header(wait_s)
        super().__init__(f"too many failed console logins: try again in {retry} s", headers=[("Retry-After", retry)])


async def logout(request: web.Request) -> web.Response:
    request.app[appkeys.CONSOLE_SESSIONS].close(request.cookies.get(COOKIE))
    response = json_reply({"authenticated": False})
    response.del_cookie(COOKIE, path="/")
    return response


async def activity(request: web.Request) -> web.Response:
    """The last hour per minute and the newest requests after `?after=<seq>`: of every replica with
    shared state (gateway/console/shared.py), else of this one."""
    view = team_view(request)  # a team admin: its teams' requests and counters, no fleet-wide ones
    keep = view.sees_request if view is not None else None
    shared = request.app.get(appkeys.SHARED_ACTIVITY)
    if shared is not None:
        found = await shared.merged(keep=keep)
    else:
        recent = request.app[appkeys.CONSOLE_ACTIVITY]
        try:
            after = int(request.query.get("after", "0"))
        except ValueError:
            after = 0
        found = {**recent.overview(), "tail": recent.tail(after, keep=keep)}
    return json_reply(found if view is None else team_activity(found, view))


def team_activity(found: dict[str, Any], view: TeamView) -> dict[str, Any]:
    """A team admin's overview: the minute counters its teams kept of their own (activity.py), per
    model too, never the fleet's (they sum every team's requests); the tail is already its teams'
    only."""
    own = team_overview(found["minutes"], view.teams, time.time())
    return {**found, **own, "team_scope": {"teams": sorted(view.teams)}}


async def usage(request: web.Request) -> web.Response:
    """Spend and usage from the ledger (its Redis stream's copy, every replica's, with `state: redis`):
    `?since=24h&until=&by=tenant,model&format=json|csv`; a team admin's count its teams' records only."""
    settings = request.app[appkeys.SETTINGS]
    config, stream = settings.ledger, settings.ledger.stream(settings.state)
    by = [f for f in request.query.get("by", "tenant").split(",") if f.strip()]
    since, until = request.query.get("since", "24h"), request.query.get("until")
    fmt = request.query.get("format", "json")
    if fmt not in ("json", "csv"):
        return json_reply({"error": {"message": "format must be json or csv", "type": "invalid_request_error",
                                     "param": "format", "code": None}}, status=400)  # fmt: skip
    view = team_view(request)
    keep = view.sees_request if view is not None else None
    rows = MAX_CSV_ROWS if fmt == "csv" else MAX_GROUPS
    try:  # every replica's records when the ledger is copied to a Redis stream (usage.py), else the files
        found = await usage_async(Path(config.dir), since, until, by, stream, keep, rows)
    except redis.RedisError as exc:  # the stream is unreachable: this replica's files, saying so
        found = await usage_async(Path(config.dir), since, until, by, None, keep, rows)
        found["stream_error"] = str(exc)[:200]
    except (ReportError, ValueError) as exc:
        return json_reply({"error": {"message": str(exc), "type": "invalid_request_error"}}, status=400)
    if fmt == "csv":
        return csv_response(found)
    if view is not None:
        found["team_scope"] = {"teams": sorted(view.teams)}
    return json_reply({**found, "ledger_enabled": config.enabled})


def oidc_handlers() -> tuple[Handler, Handler]:
    """`GET /ui/oidc/login` and `GET /ui/oidc/callback` (gateway/console/sessions.py), sharing one relying
    party per app, made on first use from `server.oidc` (404 without it)."""
    clients: dict[int, OidcClient] = {}

    def client_of(request: web.Request) -> OidcClient:
        config = request.app[appkeys.SETTINGS].server.oidc
        if config is None:
            raise OidcNotConfigured("single sign-on is not configured (server.oidc)")
        return clients.setdefault(id(config), OidcClient(config))

    def loopback_refusal(request: web.Request) -> GatewayError | None:
        if not gate_of(request.app).admin_token and not access.direct_loopback(caller_of(request)):
            return access.LoopbackOnly("the console is loopback-only without server.admin_token")
        return None

    async def start(request: web.Request) -> web.StreamResponse:
        """Send the browser to the provider, with a cookie that ties the callback to this browser."""
        try:
            client = client_of(request)
            refusal = loopback_refusal(request)
            if refusal is not None:
                raise refusal
            async with aiohttp.ClientSession() as http:
                url, flow = await client.begin(http, redirect_uri_of(request, client.config))
        except GatewayError as error:
            return error_response(error)
        response = web.Response(status=302, headers={"Location": url, **NO_STORE})
        response.set_cookie(
            FLOW_COOKIE, flow, max_age=int(PENDING_TTL_S), path="/ui/oidc", httponly=True,
            samesite="Lax", secure=request.secure,
        )  # fmt: skip
        return response

    async def callback(request: web.Request) -> web.StreamResponse:
        """The provider's answer: verified, mapped to a role, exchanged for a console session."""
        client_ip = request.remote or "local"
        try:
            client = client_of(request)
            refusal = loopback_refusal(request)
            if refusal is not None:
                raise refusal
            if any(len(request.query.getall(name, ())) > 1 for name in ("state", "code", "error")):
                raise OidcBadRequest("the callback repeats a parameter (RFC 6749 3.1: each is sent once)")
            async with aiohttp.ClientSession() as http:
                claims = await client.finish(http, request.query, request.cookies.get(FLOW_COOKIE))
            identity = identity_of_claims(claims, client.config, gate_of(request.app).users)
            if identity is None:
                who = printable(claims.get("email") or claims.get("sub"), 200)
                audit.warning("console sign-on of %r from %s refused: no role maps to it", who, client_ip)
                raise OidcRefused(f"{who} has no role on this gateway (server.users emails, server.oidc.group_roles)")
        except GatewayError as error:
            failed = error_response(error)
            failed.del_cookie(FLOW_COOKIE, path="/ui/oidc")
            return failed
        opened = open_session(request, identity, client_ip)
        response = web.Response(status=303, headers={"Location": "/ui", **NO_STORE})
        response.cookies.update(opened.cookies)
        response.del_cookie(FLOW_COOKIE, path="/ui/oidc")
        return response

    return start, callback


def console_routes() -> list[tuple[str, str, Handler]]:
    """Open routes: the pages and login (the pages hold no data; every read is an admin call), each
    behind the Host/Origin and cross-site checks; login has its own failure backoff."""
    oidc_start, oidc_callback = oidc_handlers()
    routes: list[tuple[str, str, Handler]] = [
        ("GET", "/ui", index),
        ("GET", "/ui/", index),
        ("GET", "/ui/static/{name}", asset),
        ("GET", "/ui/session", session),
        ("POST", "/ui/login", login_handler(LoginThrottle())),
        ("POST", "/ui/logout", logout),
        ("GET", "/ui/oidc/login", oidc_start),
        ("GET", CALLBACK_PATH, oidc_callback),
    ]
    return [(method, path, console_guard(handler)) for method, path, handler in routes]


def console_admin_routes() -> list[tuple[str, str, Handler]]:
    return [
        ("GET", "/admin/activity", activity),
        ("GET", "/admin/usage", usage),
        ("POST", "/admin/models/{model}/check", model_check),
        ("GET", "/admin/programs", programs),
        ("GET", "/admin/adapters", adapters_view),
    ]

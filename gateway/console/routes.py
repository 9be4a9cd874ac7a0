"""The console's routes: its static pages (/ui), login and logout, and the two admin reads only the
console needs (/admin/activity, /admin/usage); everything else it shows comes from the admin API.

Pages are committed files served as they are (no build step). Every page response forbids framing
and inline scripts (Content-Security-Policy), so a stored string rendered by mistake cannot run.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import orjson
from aiohttp import web

from gateway import appkeys
from gateway.admin_replies import json_reply
from gateway.console.sessions import COOKIE, ConsoleSessions
from gateway.console.usage import usage_async
from gateway.ledger.config import LedgerConfig
from gateway.ledger.report import ReportError
from gateway.routes import Handler
from gateway.settings import validate_section

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


async def index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html", headers={**SECURITY_HEADERS, "Content-Type": "text/html"})


async def asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    kind = ASSETS.get(name)
    if kind is None:
        raise web.HTTPNotFound()
    return web.FileResponse(STATIC / name, headers={**SECURITY_HEADERS, "Content-Type": kind})


def _loopback(request: web.Request) -> bool:
    return request.remote in ("127.0.0.1", "::1", None)


async def session(request: web.Request) -> web.Response:
    """Whether this browser is logged in, and whether logging in needs the admin token."""
    token = request.app[appkeys.SETTINGS].server.admin_token
    sessions = request.app[appkeys.CONSOLE_SESSIONS]
    return json_reply(
        {
            "authenticated": sessions.valid(request.cookies.get(COOKIE)),
            "token_required": bool(token),
            "loopback_only": not token,
        }
    )


async def login(request: web.Request) -> web.Response:
    """The admin token in the body (never the URL) for a session cookie."""
    token = request.app[appkeys.SETTINGS].server.admin_token
    try:
        body = orjson.loads(await request.read() or b"{}")
    except orjson.JSONDecodeError:
        body = {}
    presented = str(body.get("token", "")) if isinstance(body, dict) else ""
    if token:
        if not hmac.compare_digest(presented.encode(), token.encode()):
            return json_reply({"error": {"message": "wrong admin token", "type": "invalid_request_error"}}, status=401)
    elif not _loopback(request):
        return json_reply({"error": {"message": "the console is loopback-only without server.admin_token"}}, status=403)
    sessions: ConsoleSessions = request.app[appkeys.CONSOLE_SESSIONS]
    response = json_reply({"authenticated": True})
    response.set_cookie(
        COOKIE,
        sessions.open(),
        max_age=int(sessions.ttl_s),
        path="/",
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )
    return response


async def logout(request: web.Request) -> web.Response:
    request.app[appkeys.CONSOLE_SESSIONS].close(request.cookies.get(COOKIE))
    response = json_reply({"authenticated": False})
    response.del_cookie(COOKIE, path="/")
    return response


async def activity(request: web.Request) -> web.Response:
    """This replica's last hour per minute, and its newest requests after `?after=<seq>`."""
    recent = request.app[appkeys.CONSOLE_ACTIVITY]
    try:
        after = int(request.query.get("after", "0"))
    except ValueError:
        after = 0
    return json_reply({**recent.overview(), "tail": recent.tail(after)})


async def usage(request: web.Request) -> web.Response:
    """Spend and usage from the ledger: `?since=24h&until=&by=tenant,model`."""
    config = validate_section(request.app[appkeys.SETTINGS], "ledger", LedgerConfig)
    by = [f for f in request.query.get("by", "tenant").split(",") if f.strip()]
    try:
        found = await usage_async(Path(config.dir), request.query.get("since", "24h"), request.query.get("until"), by)
    except (ReportError, ValueError) as exc:
        return json_reply({"error": {"message": str(exc), "type": "invalid_request_error"}}, status=400)
    return json_reply({**found, "ledger_enabled": config.enabled})


def console_routes() -> list[tuple[str, str, Handler]]:
    """Open routes: the pages and login (the pages hold no data; every read is an admin call)."""
    return [
        ("GET", "/ui", index),
        ("GET", "/ui/", index),
        ("GET", "/ui/static/{name}", asset),
        ("GET", "/ui/session", session),
        ("POST", "/ui/login", login),
        ("POST", "/ui/logout", logout),
    ]


def console_admin_routes() -> list[tuple[str, str, Handler]]:
    return [("GET", "/admin/activity", activity), ("GET", "/admin/usage", usage)]

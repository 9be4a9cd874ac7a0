"""The audit log in the running gateway: the recording step every state-changing admin call passes,
the hook handlers fill with before and after, `GET /admin/audit`, and the log's lifetime.

`record_change` is called by the admin guard (gateway/http/routes.py) for every admitted POST, PUT,
PATCH and DELETE of the admin API, so a new admin route is recorded without doing anything. The
handler runs first; a refusal (4xx) or a failure changed nothing and leaves no record. Otherwise
one record is written and fsync'd in a worker thread before the answer is returned to aiohttp, so
an operator told "done" can find the change in the log, also after `kill -9`.

What changed is the handler's to say: `note(request, target=..., before=..., after=...)` fills a
dict the guard put on the request. A handler that says nothing still leaves a record of who called
which route on which path id, when, and with what status.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.app import keys as appkeys
from gateway.audit.store import DEFAULT_LIMIT, MAX_LIMIT, AuditLog, Change, LineSink, Query
from gateway.http.admin_replies import admin_error, json_reply
from gateway.http.team_scope import team_view
from gateway.ledger.cli import parse_time_s

log = logging.getLogger("tokenway.audit")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
AUDIT_LOG: web.AppKey[AuditLog | None] = web.AppKey("audit_log", object)  # type: ignore[arg-type]
_NOTES: web.RequestKey[dict[str, Any]] = web.RequestKey("audit_notes", dict)
SESSION_ID_CHARS = 12
MAX_FILTER_CHARS = 256


def note(request: web.Request, *, target: str | None = None, before: Any = None, after: Any = None) -> None:
    """What the handler changed, for its audit record: the object's id and its view before and after
    (secret-named fields are redacted when the record is made). No-op where nothing records."""
    notes = request.get(_NOTES)
    if notes is None:
        return
    if target is not None:
        notes["target"] = target
    if before is not None:
        notes["before"] = before
    if after is not None:
        notes["after"] = after


def actor_of(credential: str, session_cookie: str | None) -> str:
    """`credential` ("admin-token", "console", "loopback", or "user:NAME" for a user of
    `server.users`, by token or console session: gateway/http/access.py) as the record names it; a
    console session opened with the admin token by the first characters of the SHA-256 of its cookie, the id the
    gateway keeps for it (gateway/console/sessions.py), never the cookie itself."""
    if credential == "console" and session_cookie:
        digest = hashlib.sha256(session_cookie.encode("utf-8", "surrogateescape")).hexdigest()
        return f"console:{digest[:SESSION_ID_CHARS]}"
    return credential


async def record_change(
    request: web.Request, handler: Handler, credential: str, session_cookie: str | None
) -> web.StreamResponse:
    """Run an admitted state-changing admin call and, when it succeeded, record it durably."""
    audit_log = request.app.get(AUDIT_LOG)
    if audit_log is None:
        return await handler(request)
    notes: dict[str, Any] = {}
    request[_NOTES] = notes
    response = await handler(request)
    if response.status >= 400:
        return response
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    path_ids = list(request.match_info.values())
    change = Change(
        actor=actor_of(credential, session_cookie),
        client=request.remote,
        method=request.method.upper(),
        route=route,
        status=response.status,
        target=notes.get("target", path_ids[0] if path_ids else None),
        before=notes.get("before"),
        after=notes.get("after"),
        request_id=request.headers.get("x-request-id"),
    )
    try:
        await asyncio.to_thread(audit_log.append, change)
    except OSError as exc:
        # The change is made and cannot be undone here; the operator learns of the gap from the
        # log and `GET /admin/audit`'s error count rather than from a failure of a done change. The
        # line holds what the record would have (who, what, on which id, when): the disk's error
        # needs no traceback, and a full disk must not bury it under one per change.
        log.error(
            "audit log: %s %s (target %s, status %d) by %s from %s at %s was made but could not be recorded: %s",
            change.method,
            route,
            change.target,
            change.status,
            change.actor,
            change.client,
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            exc,
        )
    return response


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_LIMIT
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIMIT}") from None
    if not 1 <= value <= MAX_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIMIT}")
    return value


def _filter(request: web.Request, name: str) -> str | None:
    value = request.query.get(name)
    if value is None or value == "":
        return None
    if len(value) > MAX_FILTER_CHARS:
        raise ValueError(f"{name} is longer than {MAX_FILTER_CHARS} characters")
    return value


async def audit_list(request: web.Request) -> web.Response:
    """Admin changes, newest first: `?since=24h|ISO&actor=&action=&target=&limit=` (default 100, max 1000);
    a team admin's: its own changes and its teams' objects' only (gateway/http/team_scope.py)."""
    audit_log = request.app.get(AUDIT_LOG)
    try:
        since = _filter(request, "since")
        query = Query(
            since_s=parse_time_s(since, time.time()) if since is not None else None,
            actor=_filter(request, "actor"),
            action=_filter(request, "action"),
            target=_filter(request, "target"),
            limit=_limit(request.query.get("limit")),
            visible=view.sees_change if (view := team_view(request)) is not None else None,
        )
    except ValueError as exc:
        return admin_error(400, str(exc))
    if audit_log is None:
        return json_reply({"object": "list", "data": [], "has_more": False, "enabled": False})
    rows, more = await asyncio.to_thread(audit_log.read, query)
    return json_reply({"object": "list", "data": rows, "has_more": more, "enabled": True, "stats": audit_log.stats()})


def audit_routes() -> list[tuple[str, str, Handler]]:
    """Admin routes (mounted behind the admin guard by the app factory)."""
    return [("GET", "/admin/audit", audit_list)]


def _redis_sink(app: web.Application) -> LineSink | None:
    """The ledger's Redis stream (configured, or the state's by default), with the audit's own stream key."""
    settings = app[appkeys.SETTINGS]
    ledger = settings.ledger
    stream = ledger.stream(settings.state)
    if stream is None:
        return None
    from gateway.ledger.sinks import RedisStreamExporter

    name = ledger.audit.redis_stream
    if ledger.redis_stream is None and name == type(ledger.audit).model_fields["redis_stream"].default:
        name = f"{settings.state.key_prefix}:audit"  # on the state's Redis: under its prefix, like every key
    return RedisStreamExporter(stream.model_copy(update={"stream": name}))


async def audit_ctx(app: web.Application) -> AsyncIterator[None]:
    """Open the audit log (when enabled) for the app's lifetime; closed after the drain."""
    config = app[appkeys.SETTINGS].ledger.audit
    audit_log = await asyncio.to_thread(AuditLog, config, sink=_redis_sink(app)) if config.enabled else None
    app[AUDIT_LOG] = audit_log
    if audit_log is not None:
        log.info("audit log of admin changes: %s", audit_log.path)
    yield
    if audit_log is not None:
        await asyncio.to_thread(audit_log.close)

"""The admin guard's recording step over a real aiohttp server: every admitted change that succeeded
leaves one record naming how its caller authenticated, a route whose handler says nothing still
leaves one, refusals and reads leave none, and `GET /admin/audit` filters and bounds what it answers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.app import keys as appkeys
from gateway.app.settings import AuditConfig, GatewaySettings, ServerSettings
from gateway.audit.api import AUDIT_LOG, actor_of, audit_list, note
from gateway.audit.store import AuditLog, Query
from gateway.console.sessions import COOKIE, ConsoleSessions
from gateway.http.access import CSRF_HEADER
from gateway.http.admin_replies import admin_error, json_reply
from gateway.http.routes import admin_guard

TOKEN = "a-test-admin-token-0123"


async def noted(request: web.Request) -> web.StreamResponse:
    note(request, target="t1", before={"rpm": 1}, after={"rpm": 2, "secret": "tw-shh"})
    return json_reply({"ok": True})


async def silent(request: web.Request) -> web.StreamResponse:
    return json_reply({"ok": True})


async def refused(request: web.Request) -> web.StreamResponse:
    return admin_error(409, "no")


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Callable[[str | None], Any]]:
    servers: list[TestServer] = []

    async def start(admin_token: str | None) -> tuple[TestServer, AuditLog, ConsoleSessions]:
        app = web.Application()
        app[appkeys.SETTINGS] = GatewaySettings(server=ServerSettings(admin_token=admin_token))
        audit = AuditLog(AuditConfig(dir=str(tmp_path / f"audit{len(servers)}")))
        app[AUDIT_LOG] = audit
        sessions = ConsoleSessions()
        app[appkeys.CONSOLE_SESSIONS] = sessions
        for method, path, handler in [
            ("PATCH", "/admin/things/{thing}", noted),
            ("DELETE", "/admin/things/{thing}", silent),
            ("POST", "/admin/refused", refused),
            ("GET", "/admin/things/{thing}", silent),
            ("GET", "/admin/audit", audit_list),
        ]:
            app.router.add_route(method, path, admin_guard(handler))
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return server, audit, sessions

    yield start
    for server in servers:
        await server.close()


async def call(server: TestServer, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, server.make_url(path), headers=headers or {}) as response,
    ):
        return response.status, await response.json()


async def test_each_successful_change_is_recorded_with_its_actor_and_nothing_else_is(served: Any) -> None:
    server, audit, sessions = await served(TOKEN)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert (await call(server, "PATCH", "/admin/things/a", bearer))[0] == 200
    assert (await call(server, "DELETE", "/admin/things/b", bearer))[0] == 200
    assert (await call(server, "POST", "/admin/refused", bearer))[0] == 409  # refused: nothing changed
    assert (await call(server, "GET", "/admin/things/a", bearer))[0] == 200  # a read
    assert (await call(server, "PATCH", "/admin/things/a"))[0] == 401  # no credential
    cookie, csrf = sessions.open()
    console = {"Cookie": f"{COOKIE}={cookie}", CSRF_HEADER: csrf}
    assert (await call(server, "DELETE", "/admin/things/c", console))[0] == 200

    status, body = await call(server, "GET", "/admin/audit", bearer)
    assert status == 200 and body["object"] == "list" and body["enabled"] and not body["has_more"]
    rows = body["data"]
    assert [(r["method"], r["route"], r["target"]) for r in rows] == [
        ("DELETE", "/admin/things/{thing}", "c"),
        ("DELETE", "/admin/things/{thing}", "b"),  # the handler said nothing: the path's id
        ("PATCH", "/admin/things/{thing}", "t1"),
    ]
    assert rows[0]["actor"] == actor_of("console", cookie) and rows[0]["actor"].startswith("console:")
    assert cookie not in str(rows) and csrf not in str(rows)
    assert rows[1]["actor"] == rows[2]["actor"] == "admin-token"
    assert rows[1]["before"] is None and rows[1]["after"] is None and rows[1]["status"] == 200
    assert rows[2]["before"] == {"rpm": 1} and rows[2]["after"] == {"rpm": 2, "secret": "[redacted]"}
    assert all(r["client"] == "127.0.0.1" for r in rows)
    assert audit.written_total == 3


async def test_a_gateway_without_a_token_names_its_loopback_callers(served: Any) -> None:
    server, _audit, _sessions = await served(None)
    assert (await call(server, "DELETE", "/admin/things/x"))[0] == 200
    rows = (await call(server, "GET", "/admin/audit?actor=loopback"))[1]["data"]
    assert [(r["actor"], r["target"]) for r in rows] == [("loopback", "x")]


async def test_the_listing_filters_and_bounds_what_it_answers(served: Any) -> None:
    server, _audit, _sessions = await served(None)
    for thing in ("a", "b", "c"):
        await call(server, "DELETE", f"/admin/things/{thing}")
    await call(server, "PATCH", "/admin/things/d")

    async def targets(query: str) -> list[str]:
        status, body = await call(server, "GET", "/admin/audit?" + query)
        assert status == 200, body
        return [r["target"] for r in body["data"]]

    assert await targets("limit=2") == ["t1", "c"]
    assert await targets("action=DELETE") == ["c", "b", "a"]
    assert await targets("target=b") == ["b"]
    assert await targets("since=1h&actor=loopback") == ["t1", "c", "b", "a"]
    assert await targets("since=2000-01-01T00:00&actor=console") == []
    for bad in ("limit=0", "limit=1001", "limit=ten", "since=yesterday", "actor=" + "x" * 300):
        status, body = await call(server, "GET", "/admin/audit?" + bad)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", bad


async def raw_request(server: TestServer, head: bytes) -> int:
    """One request written byte for byte (headers no client library would send); its status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(head)
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return int(status_line.split(b" ", 2)[1])


async def test_a_change_whose_headers_or_path_are_not_valid_text_is_answered_and_recorded(served: Any) -> None:
    """aiohttp keeps undecodable header bytes as lone surrogates, which no JSON encoder accepts: the
    record is written with replacement characters (and without the unusable request id), never a
    500 for a change that was made."""
    server, audit, _ = await served(TOKEN)
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    patch = b"PATCH /admin/things/a HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + auth
    assert await raw_request(server, patch + b"x-request-id: f\xad\xab\r\nContent-Length: 0\r\n\r\n") == 200
    assert await raw_request(server, patch + b"x-request-id: req-42\r\nContent-Length: 0\r\n\r\n") == 200
    delete = b"DELETE /admin/things/%ff%fe HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + auth
    assert await raw_request(server, delete + b"x-request-id: \xea\r\nContent-Length: 0\r\n\r\n") == 200
    rows, _ = audit.read(Query())
    assert audit.written_total == 3 and len(rows) == 3
    assert [r["method"] for r in rows] == ["DELETE", "PATCH", "PATCH"]
    assert rows[1]["request_id"] == "req-42" and "request_id" not in rows[0] and "request_id" not in rows[2]
    assert isinstance(rows[0]["target"], str) and rows[0]["target"].encode("utf-8")  # valid text, recorded


async def test_a_change_the_disk_would_not_record_is_answered_and_its_line_holds_the_record(
    served: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The change is made (it cannot be undone here) and answered; the log line names what the record
    would have held, with no traceback (a full disk would bury the log under one per change)."""
    server, audit, _sessions = await served(TOKEN)

    def full_disk(change: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(audit, "append", full_disk)
    with caplog.at_level(logging.ERROR, logger="tokenway.audit"):
        assert (await call(server, "PATCH", "/admin/things/a", {"Authorization": f"Bearer {TOKEN}"}))[0] == 200
    [line] = [r for r in caplog.records if r.name == "tokenway.audit"]
    assert line.exc_info is None
    message = line.getMessage()
    assert "PATCH /admin/things/{thing} (target t1, status 200) by admin-token from 127.0.0.1" in message
    assert message.endswith("could not be recorded: [Errno 28] No space left on device")

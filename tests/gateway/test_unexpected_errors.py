"""What `bounded_bodies` (gateway/http/bodies.py) answers for an exception no handler expected: a 500 in
the route's error shape, logged once, on every route, with or without a body; and a malformed
multipart form: a 400 naming the fault, never aiohttp's plain-text 500."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gateway.http.bodies import BodyBounds, BodyBudget, bounded_bodies
from gateway.http.connections import GatewayRunner


async def broken(request: web.Request) -> web.StreamResponse:
    await request.read()
    raise RuntimeError("a bug")


async def redirect(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/elsewhere")


async def half_sent(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"partial")
    raise RuntimeError("after the headers went out")


async def form(request: web.Request) -> web.StreamResponse:
    reader = await request.multipart()
    names = []
    while (part := await reader.next()) is not None:
        assert isinstance(part, aiohttp.BodyPartReader)
        await part.read()
        names.append(part.name or "")
    return web.json_response(names)


@pytest.fixture
async def served() -> AsyncIterator[str]:
    bounds = BodyBounds(max_body_bytes=50_000, read_timeout_s=5, budget=BodyBudget(100_000))
    app = web.Application(middlewares=[bounded_bodies(bounds)])
    app.router.add_route("*", "/broken", broken)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/half", half_sent)
    app.router.add_post("/form", form)
    runner = GatewayRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("method", "body"), [("GET", None), ("POST", b'{"a": 1}')])
async def test_an_unexpected_exception_is_a_logged_500_in_the_api_shape(
    served: str, method: str, body: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        async with aiohttp.ClientSession() as session, session.request(method, served + "/broken", data=body) as resp:
            assert resp.status == 500 and resp.content_type == "application/json"
            error = (await resp.json())["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "a bug" not in error["message"]  # the detail is in the log, not the answer
    logged = [r for r in caplog.records if r.exc_info and "a bug" in str(r.exc_info[1])]
    assert len(logged) == 1


async def test_aiohttps_own_http_answers_pass_through(served: str) -> None:
    async with aiohttp.ClientSession() as session, session.get(served + "/redirect", allow_redirects=False) as resp:
        assert resp.status == 302 and resp.headers["Location"] == "/elsewhere"


async def test_an_answer_already_sent_is_cut_not_replaced(served: str) -> None:
    async with aiohttp.ClientSession() as session, session.get(served + "/half") as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()


@pytest.mark.parametrize(
    "name",
    [b"a\rb", b"a\nb", b"a\r\nb", b"a\x00b"],
    ids=["CR", "LF", "CRLF", "NUL"],
)
async def test_a_part_header_with_control_bytes_is_a_400_naming_it(served: str, name: bytes) -> None:
    body = b'--B\r\nContent-Disposition: form-data; name="' + name + b'"\r\n\r\nv\r\n--B--\r\n'
    headers = {"Content-Type": "multipart/form-data; boundary=B"}
    async with aiohttp.ClientSession() as session, session.post(served + "/form", data=body, headers=headers) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("the multipart form is malformed: Invalid HTTP header")


_NESTED = b"--B\r\nContent-Type: multipart/mixed; boundary=C\r\n\r\n--C--\r\n--B--\r\n"


@pytest.mark.parametrize(
    ("content_type", "body", "said"),
    [
        ("multipart/form-data", b"--B\r\n\r\nv\r\n--B--\r\n", "boundary"),
        ("multipart/form-data; boundary=B", b"--C\r\n\r\nv\r\n--C--\r\n", "boundary"),
        ("multipart/form-data; boundary=B", _NESTED, "nest"),
    ],
    ids=["no boundary", "wrong boundary", "nested form"],
)
async def test_a_malformed_form_is_a_400(served: str, content_type: str, body: bytes, said: str) -> None:
    headers = {"Content-Type": content_type}
    async with aiohttp.ClientSession() as session, session.post(served + "/form", data=body, headers=headers) as resp:
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and said in error["message"], error

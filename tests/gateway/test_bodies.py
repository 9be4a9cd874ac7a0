"""The body bounds (gateway/http/bodies.py): the JSON depth bound and its path, strict content decoding,
the budget, and the middleware on a real listening runner (GatewayRunner: aiohttp's own decoding off)."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.errors import InvalidRequest, RequestTooLarge
from gateway.http.bodies import (
    MAX_JSON_DEPTH,
    BodyBounds,
    BodyBudget,
    bounded_bodies,
    check_depth,
    decode_body,
    json_body,
    parse_json_body,
)
from gateway.http.connections import GatewayRunner


def nested(levels: int) -> bytes:
    return b'{"a": {"b": [' + b"[" * (levels - 3) + b"]" * (levels - 3) + b"]}}"


def test_a_body_at_the_bound_parses() -> None:
    assert parse_json_body(nested(MAX_JSON_DEPTH))["a"]["b"] == orjson.loads(nested(MAX_JSON_DEPTH))["a"]["b"]


def test_one_level_more_is_a_400_naming_the_path() -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_json_body(nested(MAX_JSON_DEPTH + 1))
    assert caught.value.param is not None and caught.value.param.startswith("a.b[0][0]")
    assert f"more than {MAX_JSON_DEPTH} levels" in caught.value.message


def test_a_long_path_is_shortened() -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_json_body(b"[" * 300 + b"]" * 300)
    assert caught.value.param is not None and caught.value.param.endswith("...") and len(caught.value.param) < 200


def test_brackets_inside_strings_do_not_count() -> None:
    body = orjson.dumps({"text": "[" * 500})
    assert parse_json_body(body) == {"text": "[" * 500}
    assert parse_json_body(body.decode()) == {"text": "[" * 500}


def test_a_large_body_is_judged_by_its_containers_not_its_bytes() -> None:
    # above the size where brackets are no longer counted, the walk still finds a deep field
    padding = "word " * 10_000
    deep = {"prompt": padding, "x": orjson.loads(nested(MAX_JSON_DEPTH))}
    with pytest.raises(InvalidRequest) as caught:
        parse_json_body(orjson.dumps(deep))
    assert caught.value.param is not None and caught.value.param.startswith("x.a.b")
    shallow = {"prompt": padding, "messages": [{"role": "user", "content": "[" * 5_000}]}
    assert parse_json_body(orjson.dumps(shallow)) == shallow


def test_not_json_is_a_400() -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_json_body(b"{nope")


@pytest.mark.slow
def test_the_walk_is_iterative() -> None:
    value: Any = []
    for _ in range(100_000):  # far deeper than the interpreter's recursion limit
        value = [value]
    with pytest.raises(InvalidRequest):
        check_depth(value, 64)


GOOD = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def test_gzip_and_deflate_decode() -> None:
    assert decode_body(gzip.compress(GOOD), ["gzip"], 10_000) == GOOD
    assert decode_body(gzip.compress(GOOD), ["x-gzip"], 10_000) == GOOD
    assert decode_body(zlib.compress(GOOD), ["deflate"], 10_000) == GOOD
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode_body(raw.compress(GOOD) + raw.flush(), ["deflate"], 10_000) == GOOD


@pytest.mark.parametrize(
    ("body", "codings", "words"),
    [
        pytest.param(gzip.compress(GOOD)[:-10], ["gzip"], "truncated", id="truncated"),
        pytest.param(gzip.compress(GOOD) * 2, ["gzip"], "after the end", id="two-members"),
        pytest.param(gzip.compress(GOOD) + b"x", ["gzip"], "after the end", id="trailing"),
        pytest.param(gzip.compress(gzip.compress(GOOD)), ["gzip", "gzip"], "at most one", id="doubled"),
        pytest.param(GOOD, ["gzip"], "not valid gzip", id="not-gzip"),
        pytest.param(GOOD, ["br"], "unsupported", id="unsupported"),
    ],
)
def test_a_body_that_is_not_exactly_its_coding_is_a_400(body: bytes, codings: list[str], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as caught:
        decode_body(body, codings, 10_000)
    assert caught.value.param == "Content-Encoding"


def test_a_body_that_inflates_past_the_limit_is_a_413() -> None:
    with pytest.raises(RequestTooLarge):
        decode_body(gzip.compress(b" " * 1_000_000), ["gzip"], 10_000)


def test_the_budget_refuses_what_does_not_fit_and_takes_back_what_is_given() -> None:
    budget = BodyBudget(100)
    assert budget.take(60) and not budget.take(41) and budget.take(40)
    budget.give(60)
    assert budget.used_bytes == 40 and budget.take(60) and budget.refused == 1


# --- the middleware on a real listening runner -----------------------------------------------------
async def echo(request: web.Request) -> web.Response:
    body = await json_body(request)
    return web.json_response({"keys": sorted(body)})


async def upload(request: web.Request) -> web.Response:
    reader = await request.multipart()
    names = []
    while (part := await reader.next()) is not None:
        names.append(getattr(part, "name", None))
        await part.read()  # type: ignore[union-attr]
    return web.json_response({"parts": names})


@pytest.fixture
async def served() -> AsyncIterator[str]:
    bounds = BodyBounds(max_body_bytes=50_000, read_timeout_s=0.5, budget=BodyBudget(20_000), max_form_parts=3)
    app = web.Application(middlewares=[bounded_bodies(bounds)])
    app.router.add_post("/echo", echo)
    app.router.add_post("/upload", upload)
    runner = GatewayRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def post(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    async with (
        aiohttp.ClientSession(auto_decompress=False) as session,
        session.post(url, data=data, headers=headers or {}) as response,
    ):
        return response.status, dict(response.headers), orjson.loads(await response.read())


async def test_a_body_is_read_decoded_and_parsed(served: str) -> None:
    status, _, parsed = await post(served + "/echo", gzip.compress(GOOD), {"Content-Encoding": "gzip"})
    assert (status, parsed) == (200, {"keys": ["messages", "model"]})


async def test_a_deep_body_is_refused_by_the_reader_whatever_the_handler(served: str) -> None:
    status, _, parsed = await post(served + "/echo", b'{"x": ' + b"[" * 100 + b"]" * 100 + b"}")
    assert status == 400 and parsed["error"]["param"].startswith("x[0]")


async def test_a_body_over_the_budget_is_a_503_with_retry_after(served: str) -> None:
    status, headers, parsed = await post(served + "/echo", b'{"x": "' + b"y" * 30_000 + b'"}')
    assert status == 503 and headers["Retry-After"] == "1"
    assert parsed["error"]["code"] == "overloaded"
    status, _, _ = await post(served + "/echo", GOOD)  # nothing stays held
    assert status == 200


async def test_a_body_over_the_size_is_a_413_in_openais_shape(served: str) -> None:
    status, _, parsed = await post(served + "/echo", b'{"x": "' + b"y" * 60_000 + b'"}')
    assert status == 413 and parsed["error"]["code"] == "request_too_large"


async def test_a_form_with_too_many_parts_is_a_400(served: str) -> None:
    form = aiohttp.FormData()
    for i in range(5):
        form.add_field(f"f{i}", b"v", filename=f"f{i}.txt")
    async with aiohttp.ClientSession() as session:
        async with session.post(served + "/upload", data=form) as response:
            assert response.status == 400
            assert "more than 3 parts" in (await response.json())["error"]["message"]
        form = aiohttp.FormData()
        form.add_field("purpose", b"batch", filename="p.txt")
        async with session.post(served + "/upload", data=form) as response:
            assert response.status == 200


@pytest.mark.slow
async def test_a_slow_body_is_a_408_and_the_connection_closes(served: str) -> None:
    host, port = served.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                 b"Content-Length: 900\r\n\r\n--b\r\n")  # fmt: skip
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=20)  # to the end: the gateway closes
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"request_timeout" in answer

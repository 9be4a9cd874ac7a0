"""The batch runner's one way into the request walk: `RunLine` over the director's in-process entry.

A line runs as the key that created its batch, at the lowest priority band (flow control serves it
last; the SLO classes do not apply to it), through `Director.serve_line`: the same intake checks,
admission (at the batch price), routing, hooks — the batch gate among them —, fallbacks and
accounting as any request, with a ledger record that names the batch. Over HTTP loopback the line
would also pay a second parse, a socket round trip and an authentication with a key the gateway
only knows by its hash; in process it pays none of them.
"""

from __future__ import annotations

import dataclasses

import orjson
from aiohttp import web

from gateway.apis.responses import ResponsesCall
from gateway.apis.store import ResponseStore
from gateway.batch.lines import LineAnswer, LineRequest, RunLine
from gateway.request import Director
from policies.schema import PRIORITY_VALUES

LOWEST_PRIORITY = PRIORITY_VALUES["sheddable"]


def walk_runner(director: Director, responses: ResponseStore | None) -> RunLine:
    async def run_line(line: LineRequest) -> LineAnswer:
        call = ResponsesCall(responses) if line.api == "responses" else None
        principal = dataclasses.replace(line.principal, priority=LOWEST_PRIORITY)
        answer = await director.serve_line(
            call or line.api, line.body, principal, request_id=line.request_id, batch_id=line.batch_id
        )
        if call is not None:
            await call.finished()  # a stored response (store: true) is kept, as for a live request
        body = answer.body if isinstance(answer, web.Response) and isinstance(answer.body, bytes) else b""
        return LineAnswer(answer.status, body, dict(answer.headers), _code(body) if answer.status >= 400 else None)

    return run_line


def _code(body: bytes) -> str | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else None

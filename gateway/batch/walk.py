"""The batch runner's one way into the request walk: `RunLine` over the director's walk, with a
transport that answers the line in process.

A line runs as the key that created its batch, at the lowest priority band (flow control serves it
last; the SLO classes do not apply to it), through `Director.walk`: the same intake checks,
admission (at the batch price), routing, hooks — the batch gate among them —, fallbacks and
accounting as any request, with a ledger record that names the batch. `LineTransport` sends it as
the engine transport sends any unstreamed request and hands the answer, read whole, to the runner.
Over HTTP loopback the line would also pay a second parse, a socket round trip and an
authentication with a key the gateway only knows by its hash; in process it pays none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import orjson
from aiohttp import web

from backends.fleet import Pool
from gateway.apis.responses import ResponsesCall
from gateway.apis.store import ResponseStore
from gateway.batch.lines import LineAnswer, LineRequest, RunLine
from gateway.errors import GatewayError
from gateway.request import Director, RequestContext, Routed
from gateway.request.apis import APIS
from gateway.request.transport import Transport
from policies.schema import PRIORITY_VALUES

LOWEST_PRIORITY = PRIORITY_VALUES["sheddable"]


class LineTransport:
    """A batch line's answer, to the batch runner: the engine transport's (a line is never
    streamed), as a `LineAnswer`."""

    follows = False

    def __init__(self, engine: Transport[web.StreamResponse]) -> None:
        self.engine = engine

    def unreachable(self, pools: Sequence[Pool]) -> set[str]:
        return self.engine.unreachable(pools)

    async def send(self, ctx: RequestContext, routed: Routed, *, last: bool) -> LineAnswer:
        return _line_answer(await self.engine.send(ctx, routed, last=last))

    def refuse(self, ctx: RequestContext, error: GatewayError, headers: Iterable[tuple[str, str]]) -> LineAnswer:
        return _line_answer(self.engine.refuse(ctx, error, headers))


def walk_runner(director: Director, responses: ResponseStore | None) -> RunLine:
    transport = LineTransport(director.transport)

    async def run_line(line: LineRequest) -> LineAnswer:
        call = ResponsesCall(responses) if line.api == "responses" else None
        principal = dataclasses.replace(line.principal, priority=LOWEST_PRIORITY)
        ctx = director.arrive(call or APIS[line.api], line.request_id)
        answer = await director.walk(
            ctx, lambda: director.intake.line(ctx, line.body, principal, line.batch_id), transport
        )
        if call is not None:
            await call.finished()  # a stored response (store: true) is kept, as for a live request
        return answer

    return run_line


def _line_answer(answer: web.StreamResponse) -> LineAnswer:
    body = answer.body if isinstance(answer, web.Response) and isinstance(answer.body, bytes) else b""
    return LineAnswer(answer.status, body, dict(answer.headers), _code(body) if answer.status >= 400 else None)


def _code(body: bytes) -> str | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else None

"""One batch line: served through the request walk in process, and what its answer means for the line.

`RunLine` is the one function between the batch runner and the request walk: it takes a line (its
API, body and the principal of the key that created the batch) and returns the answer a client
would have got — status, body, headers. The runner then decides, by `classify`:

- `done`: record it (2xx to the output file; a 4xx, or a 5xx after `max_attempts`, to the error
  file: what the line asked for cannot be served);
- `later`: the answer says "not now" — rate limited (429), budget exhausted, no spare capacity for
  batch work, no healthy endpoint or an SLO/queue 503 — so the line goes back, to be claimed again
  after the answer's retry-after (bounded), and counts nowhere yet;
- `retry`: the upstream failed (5xx): back, with backoff, counted as an attempt.

## Through the walk (`walk_runner`, `LineTransport`)

The batch runner's one way into the request walk: `RunLine` over the director's walk, with a
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import orjson
from aiohttp import web

from backends.fleet import Pool
from gateway.apis.responses import ResponsesCall
from gateway.apis.store import ResponseStore
from gateway.errors import GatewayError
from gateway.request import Director, RequestContext, Routed
from gateway.request.apis import APIS
from gateway.request.context import Transport
from policies.schema import PRIORITY_VALUES
from policies.types import Principal

Verdict = Literal["done", "later", "retry"]

# The batch gate's answer when no endpoint of the pool has spare capacity for batch work.
NO_SPARE_CAPACITY: Final = "batch_no_spare_capacity"
_LATER_CODES: Final = frozenset({"rate_limit_exceeded", "insufficient_quota", NO_SPARE_CAPACITY})


@dataclass(frozen=True, slots=True)
class LineRequest:
    batch_id: str
    index: int
    custom_id: str
    api: str  # chat | completions | embeddings | responses
    body: dict[str, Any]
    principal: Principal
    request_id: str


@dataclass(frozen=True, slots=True)
class LineAnswer:
    status: int
    body: bytes
    headers: Mapping[str, str]
    code: str | None = None  # the error code, when the walk refused it


class RunLine(Protocol):
    async def __call__(self, line: LineRequest) -> LineAnswer: ...


def classify(answer: LineAnswer) -> Verdict:
    if 200 <= answer.status < 300:
        return "done"
    if answer.code in _LATER_CODES or answer.status in (429, 503, 408):
        return "later"
    if answer.status >= 500:
        return "retry"
    return "done"


def retry_after_s(answer: LineAnswer) -> float | None:
    """The answer's own retry-after (ms precision when given), if any."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = answer.headers.get(name)
        if raw is None:
            continue
        try:
            return max(float(raw) * scale, 0.0)
        except ValueError:
            continue
    return None


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

"""`POST /v1/programs/{id}/outcome`: how an agent program ended, for cost per outcome (issue 44).

A client that ran a program (docs/agents.md) says once whether it succeeded and, optionally, what it
was worth (`{"success": true, "value": 3}`: tickets closed, tests passed, dollars earned). The
gateway writes one ledger record of kind `outcome` beside the program's request records, and
`tokenway usage report --by outcome` divides the program's cost by its successes and its value.

Programs are per tenant, so the caller is an API key of the tenant whose program it is, and the id is
bounded exactly as intake bounds program ids (`gateway/request/intake.py`): a client posts the id
it sent and the record joins the requests that carried it. One outcome per program and tenant: a
second one answers 409, so a retried POST cannot count a success twice. What was claimed lives in
Redis with `state: redis` (every replica answers the same; kept `RETAIN_S`), else in this process,
bounded to `MAX_REMEMBERED` claims (the oldest forgotten first).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Final

import orjson
from aiohttp import web
from redis.asyncio import Redis

from gateway.app import keys as appkeys
from gateway.errors import GatewayError, InvalidRequest, Rejected, error_response
from gateway.http.admin_replies import json_reply
from gateway.http.bodies import json_body
from gateway.request.intake import authenticate, request_id
from policies.routing.pipeline import bounded_key
from policies.types import Principal, Rejection, Usage

log = logging.getLogger("tokenway.outcome")

PATH: Final = "/v1/programs/{program}/outcome"
MAX_REMEMBERED: Final = 100_000  # claims one process keeps without Redis
RETAIN_S: Final = 90 * 86_400  # how long Redis remembers a program's outcome
MAX_VALUE: Final = 1e15  # |value| above this is refused: a report's sums stay exact enough
FIELDS: Final = frozenset({"success", "value"})


class OutcomeExists(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "outcome_exists"


class LedgerOff(GatewayError):
    status = 503
    type = "server_error"
    code = "ledger_disabled"


class OutcomeBook:
    """Which (tenant, program) already has its outcome: `claim` is True once per pair."""

    def __init__(self, redis: Redis | None = None, prefix: str = "tokenway") -> None:
        self._redis = redis
        self._tag = "{" + prefix + "}:outcome:"
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    async def claim(self, tenant: str, program: str) -> bool:
        if self._redis is not None:
            return bool(await self._redis.set(f"{self._tag}{tenant}|{program}", b"1", nx=True, ex=RETAIN_S))
        key = (tenant, program)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > MAX_REMEMBERED:
            self._seen.popitem(last=False)
        return True

    async def forget(self, tenant: str, program: str) -> None:
        """Undo a claim whose record could not be written (the client may post it again)."""
        if self._redis is not None:
            await self._redis.delete(f"{self._tag}{tenant}|{program}")
        else:
            self._seen.pop((tenant, program), None)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


BOOK: web.AppKey[OutcomeBook] = web.AppKey("outcome_book", OutcomeBook)


def parse_outcome(body: Any) -> tuple[bool, float | None]:
    """(success, value) of a body; InvalidRequest naming the field otherwise."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidRequest(
            f"unknown field {unknown[0][:64]!r}; an outcome has 'success' and 'value'", param=unknown[0][:64]
        )
    success = body.get("success")
    if not isinstance(success, bool):
        raise InvalidRequest("'success' is required: true or false", param="success")
    value = body.get("value")
    if value is None:
        return success, None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest("'value' must be a number", param="value")
    if abs(value) > MAX_VALUE:
        raise InvalidRequest(f"'value' must be at most {MAX_VALUE:g} in size", param="value")
    return success, float(value)


def outcome_line(
    *, request: str, tenant: str, key_id: str, program: str, success: bool, value: float | None, now_s: float
) -> bytes:
    """The ledger line of an outcome (gateway/ledger/writer.py: `kind: outcome`; readers of request records skip it)."""
    entry = {
        "v": 1,
        "kind": "outcome",
        "ts": round(now_s, 6),
        "started": round(now_s, 6),
        "request_id": request,
        "tenant": tenant,
        "key_id": key_id,
        "program": program,
        "success": success,
        "value": value,
    }
    return orjson.dumps(entry) + b"\n"


async def _charge_request(request: web.Request, principal: Principal) -> None:
    """One request against the key's request limits (RPM, RPD; never tokens), before the body is read,
    as Files and Batch calls are counted: a key cannot fill the ledger with outcomes faster than it
    may call."""
    admission = request.app[appkeys.ADMISSION]
    admitted = await admission.admit_request(principal, f"POST {PATH}")
    if isinstance(admitted, Rejection):
        raise Rejected(admitted)
    await admission.settle(admitted, Usage(), model="")  # requests buckets: nothing to correct


async def post_outcome(request: web.Request) -> web.Response:
    try:
        principal = authenticate(request, request.app[appkeys.POLICIES].current)
        await _charge_request(request, principal)
        program = bounded_key(request.match_info["program"])
        success, value = parse_outcome(await json_body(request))
        ledger = request.app[appkeys.LEDGER]
        if ledger is None:
            raise LedgerOff("the usage ledger is off (ledger.enabled): outcomes are not recorded")
        if not await request.app[BOOK].claim(principal.tenant, program):
            raise OutcomeExists(f"program {program!r} of tenant {principal.tenant!r} already has its outcome")
    except GatewayError as error:
        return error_response(error)
    rid = request_id(request.headers)
    line = outcome_line(
        request=rid,
        tenant=principal.tenant,
        key_id=principal.key_id,
        program=program,
        success=success,
        value=value,
        now_s=time.time(),
    )
    if not ledger.append_line(line):  # the ledger is behind its disk: nothing was recorded
        await request.app[BOOK].forget(principal.tenant, program)
        return error_response(LedgerOff("the usage ledger is behind its disk; post the outcome again later"))
    metrics = request.app.get(appkeys.METRICS)
    if metrics is not None:
        metrics.observe_outcome(principal.tenant, success, value)
    body = {"object": "program.outcome", "program": program, "success": success, "value": value}
    return json_reply(body, status=201, headers={"x-request-id": rid})


async def outcome_ctx(app: web.Application) -> AsyncIterator[None]:
    """The book of claimed outcomes: Redis with `state: redis`, else this process."""
    state = app[appkeys.SETTINGS].state
    redis = Redis.from_url(state.redis_url) if state.backend == "redis" and state.redis_url else None
    book = app[BOOK] = OutcomeBook(redis, state.key_prefix)
    yield
    await book.close()


def setup_outcome_routes(app: web.Application) -> None:
    app.router.add_post(PATH, post_outcome)
    app.cleanup_ctx.append(outcome_ctx)

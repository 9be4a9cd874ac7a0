"""`POST /admin/models/{model}/check`: the console's "Test this model", one tiny chat request through
the gateway's own walk, answered with its outcome and latency.

The check runs as the batch lines do (gateway/batch/lines.py: in process, the engine transport's answer
read whole), through the same intake, admission, routing and accounting as a client's request, so it
tests what a client would meet: the model's pool, a ready replica, the engine answering. Its caller
is an internal principal that no key authenticates as: key `check:<actor>` (the admin who asked, as
the audit log names them) of tenant `@check`. No customer key is billed; the ledger records the
check as that key's one request (cost included: a hosted model charges for it), and the audit log
records the admin's POST. `max_tokens` is 1, no fallback is taken (a fallback would answer for
another model), and the walk is cancelled after `CHECK_TIMEOUT_S` (its record then says aborted).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import orjson
from aiohttp import web

from gateway.app import keys as appkeys
from gateway.audit.api import note
from gateway.batch.lines import LineTransport
from gateway.http.access import identity_of
from gateway.http.admin_replies import admin_error, json_reply
from gateway.request.apis import APIS
from policies.schema import PRIORITY_VALUES
from policies.types import Principal

CHECK_TIMEOUT_S = 30.0
CHECK_TENANT = "@check"
PROMPT = "Reply with one word: OK."


def check_principal(actor: str) -> Principal:
    """The caller of a check: named after the admin who asked, of no tenant a client can hold."""
    return Principal(
        key_id=f"check:{actor}"[:200],
        tenant=CHECK_TENANT,
        allowed_models=None,
        priority=PRIORITY_VALUES["normal"],
        allow_fallback=False,
        source="check",
    )


async def model_check(request: web.Request) -> web.StreamResponse:
    model = request.match_info["model"]
    fleet = request.app[appkeys.FLEET]
    if not fleet.pools_for_model(request.app[appkeys.POLICIES].current.resolve_model(model)):
        return admin_error(404, f"no model {model!r} is served here", "model")
    director = request.app[appkeys.DIRECTOR]
    principal = check_principal(identity_of(request).actor)
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    ctx = director.arrive(APIS["chat"], f"check-{secrets.token_hex(8)}")
    transport = LineTransport(director.transport)
    started = time.perf_counter()
    try:
        answer = await asyncio.wait_for(
            director.walk(ctx, lambda: director.intake.internal(ctx, body, principal), transport), CHECK_TIMEOUT_S
        )
        status, code, message = answer.status, answer.code, _message(answer.body)
    except TimeoutError:
        status, code, message = 504, "check_timeout", f"no answer within {CHECK_TIMEOUT_S:.0f} s"
    record = ctx.record
    result: dict[str, Any] = {
        "model": model,
        "ok": status == 200,
        "status": status,
        "latency_ms": round((time.perf_counter() - started) * 1000.0, 1),
        "ttft_ms": round(record.ttft_s * 1000.0, 1) if record.ttft_s is not None else None,
        "served_by": record.model or None,
        "endpoint": record.endpoint or None,
        "request_id": record.request_id,
        "key_id": principal.key_id,
        "input_tokens": record.prompt_tokens,
        "output_tokens": record.completion_tokens,
        "cost_usd": round(record.cost_usd, 9),
        "error": None if status == 200 else {"code": code, "message": message},
    }
    note(request, target=model, after={k: result[k] for k in ("ok", "status", "latency_ms", "endpoint", "request_id")})
    return json_reply(result)


def _message(body: bytes) -> str | None:
    """An error answer's message (the walk's errors are in OpenAI's shape), never a completion's text."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message)[:500] if message is not None else None

"""The PD prefill leg: a disaggregated request's prompt prefilled on the prefill endpoint the router
chose (`policies/routing/pd.py`), its KV cache handed to the decode endpoint through the transfer
parameters the prefill answer carries (the engine adapter writes both legs' bodies).

A failed leg (refused, 5xx, 4xx, no transfer parameters) is a KV-transfer failure: the record says
so and the request goes on as prefill + decode on the decode endpoint; a 5xx counts against the
prefill endpoint only if the decode endpoint then serves the request.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from backends.adapters import get_adapter
from backends.types import PdError
from gateway.request.context import RequestContext
from gateway.upstream.relay import RetryableUpstream, UpstreamRejected, call_json
from policies.routing.types import RouteDecision

if TYPE_CHECKING:
    from gateway.transport.engine import EngineTransport

log = logging.getLogger("tokenway.request")


async def prefill_leg(
    engine: EngineTransport, ctx: RequestContext, decision: RouteDecision, body: dict[str, Any], path: str
) -> dict[str, Any] | None:
    """Run the prefill leg; the decode leg's body, or None when the decode endpoint must prefill."""
    prefill = decision.prefill_endpoint
    assert prefill is not None
    adapter = get_adapter(decision.endpoint.engine)
    load = prefill.inflight.begin(decision.uncached_prefill_tokens(ctx.facts.prompt_tokens))
    try:
        leg = engine.target(ctx, prefill, adapter.prefill_leg_body(body), path)
        with ctx.trace.span("prefill", endpoint=prefill.id):
            answer = await call_json(engine.upstream, leg)
        decode_body = adapter.decode_leg_body(body, answer)
    except (RetryableUpstream, UpstreamRejected, PdError) as exc:
        if isinstance(exc, RetryableUpstream) and exc.status:
            ctx.answered_5xx.append(prefill)  # counted only if the decode endpoint then serves it
        elif isinstance(exc, RetryableUpstream):
            engine.report_failure(prefill, time.monotonic())
        ctx.record.kv_transfer_failed = True
        log.warning("PD prefill leg on %s failed, decoding endpoint prefills: %s", prefill.id, exc)
        return None
    finally:
        load.end()
    engine.report_success(prefill)
    if "kv_transfer_params" not in decode_body and "disaggregated_params" not in decode_body:
        ctx.record.kv_transfer_failed = True
        return None
    return decode_body

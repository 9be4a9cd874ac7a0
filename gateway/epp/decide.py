"""The endpoint picker's transport: the HTTP gateway's walk, answered to Envoy (Envoy relays).

    arrive (Envoy's headers) -> the walk (`Director.walk`: intake, admit, prepare hooks, route on
    the model's pools, gate, commit), routing only among the endpoints the data plane allows
    (`x-gateway-destination-endpoint-subset`) -> `EppTransport.send`: Picked, the endpoint as
    `ip:port` and the body Envoy sends on (the served model name, stream usage on, engine shaping,
    the client's engine-control fields dropped unless its tenant may set them, the tier's
    priority), or the client's own bytes when none of that changed anything

and then `Following` watches the response Envoy streams back: the SSE events as the HTTP gateway's
relay reads them (first token for the hooks and the predictor, usage, tokens counted, the usage
chunk dropped when the client did not ask for it, the model name back to the public one), and at
the end (or when the stream is cut) it ends the attempt, settles the reservation exactly once and
hands the record to the sinks (metrics, ledger), as the HTTP gateway does: the transport `follows`.

Every "no" is an immediate response in the API's own error shape (`EppTransport.refuse`): 4xx for
the client's mistakes, 429 for limits and budgets (and for a request the SLO policy sheds), 503 when
no endpoint (of the allowed subset) can serve or the SLO gate refuses. Fallbacks to another model
are not taken (the facts say so): the request belongs to the InferencePool Envoy routed it to, and
Envoy, not the picker, retries on another endpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from functools import partial

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from backends.fleet import Pool
from backends.types import Endpoint, EventBuffer, EventTooLarge, LoadTicket
from gateway.client_text import valid_request_id
from gateway.epp.exchange import Picked, Refused
from gateway.errors import EngineRejected, GatewayError, InvalidRequest
from gateway.request.accounting import Accounting
from gateway.request.apis import APIS
from gateway.request.context import Hooks, RequestContext, Routed
from gateway.request.director import Director
from gateway.transport.engine import EngineTransport, answer_headers
from gateway.upstream.relay import RelayOutcome, relay_events
from policies.types import RequestFacts, Usage

log = logging.getLogger("tokenway.epp")

# the OpenAI routes an InferencePool serves (GIE's model servers speak OpenAI's API)
API_BY_PATH: Mapping[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
_SKIPPED_HEADERS = frozenset({"content-type", "content-length"})


def host_port(endpoint: Endpoint) -> str:
    """`ip:port` of an endpoint's base URL (what Envoy connects to)."""
    netloc = endpoint.base_url.split("://", 1)[-1].split("/", 1)[0]
    return netloc


def refused_from(ctx: RequestContext | None, error: GatewayError, headers: Sequence[tuple[str, str]]) -> Refused:
    response = ctx.render_error(error, headers) if ctx is not None else APIS["chat"].render_error(error, headers)
    body = response.body if isinstance(response.body, bytes) else b""
    extra = [(k, v) for k, v in response.headers.items() if k.lower() not in _SKIPPED_HEADERS]
    return Refused(response.status, body, extra, details=error.code or error.type)


class EppDecider:
    """The picker's entry: one `decide` per request Envoy shows it, on the director's walk."""

    def __init__(self, *, director: Director, engine: EngineTransport) -> None:
        self.director = director
        self.engine = engine  # what an endpoint is sent (the body) and what the answer carries (headers)
        self.accounting: Accounting = director.accounting
        self.hooks: Hooks = director.hooks
        self.open = 0  # requests picked whose response has not ended

    async def decide(self, headers: dict[str, str], body: bytes, subset: Sequence[str] | None) -> Picked | Refused:
        path = headers.get(":path", "").split("?", 1)[0]
        kind = API_BY_PATH.get(path)
        # the client's id only when it is short visible ASCII, as on the gateway's own routes
        request_id = valid_request_id(headers.get("x-request-id")) or os.urandom(16).hex()
        if kind is None:
            error = InvalidRequest(f"the endpoint picker serves {', '.join(API_BY_PATH)}, not {path!r}")
            error.status = 404
            return refused_from(None, error, [("x-request-id", request_id)])
        director = self.director
        ctx = director.arrive(APIS[kind], request_id, headers)

        async def read() -> RequestFacts:
            facts = await director.intake.facts(ctx, body, CIMultiDictProxy(CIMultiDict(headers)))
            return dataclasses.replace(facts, allow_fallback=False)  # the InferencePool's model, or nothing

        return await director.walk(ctx, read, EppTransport(self, body, subset))


class EppTransport:
    """One request's answer to Envoy: the pick (or the refusal), then its response followed."""

    follows = True

    def __init__(self, decider: EppDecider, body: bytes, subset: Sequence[str] | None) -> None:
        self.decider = decider
        self.body = body  # the client's, as Envoy sent it
        self.subset = subset

    def unreachable(self, pools: Sequence[Pool]) -> set[str]:
        return _outside(pools, self.subset)

    def refuse(self, ctx: RequestContext, error: GatewayError, headers: Iterable[tuple[str, str]]) -> Refused:
        return refused_from(ctx, error, list(headers))

    async def send(self, ctx: RequestContext, routed: Routed, *, last: bool) -> Picked:
        facts, endpoint = ctx.facts, routed.endpoint
        upstream_body = self.decider.engine.upstream_body(ctx, endpoint)
        # Envoy forwards only what the picker sends back: the walk's body, engine-control fields as
        # policy allows. One the walk left as it was (nothing dropped, renamed or added) goes byte for byte.
        changed = bool(ctx.dropped_fields) or upstream_body != facts.body
        upstream = orjson.dumps(upstream_body) if changed else self.body
        local_prefill = max(facts.prompt_tokens - routed.decision.cached_tokens_estimate, 0)
        headers = answer_headers(ctx, routed.decision)
        follower = Following(self.decider, ctx, endpoint.inflight.begin(local_prefill), headers)
        ctx.record.gateway_overhead_s = time.perf_counter() - ctx.arrived_s
        self.decider.open += 1
        added = [("x-request-id", ctx.record.request_id)]
        return Picked([host_port(endpoint)], upstream, follower, headers=added, body_changed=changed)


def _outside(pools: Sequence[Pool], subset: Sequence[str] | None) -> set[str]:
    """Ids of the endpoints the data plane did not allow (none excluded without a subset hint)."""
    if subset is None:
        return set()
    allowed = set(subset)
    return {e.id for pool in pools for e in pool.endpoints if host_port(e) not in allowed}


class Following:
    """One picked request's response, as Envoy shows it (implements `exchange.Follower`)."""

    def __init__(self, decider: EppDecider, ctx: RequestContext, load: LoadTicket, headers: list[tuple[str, str]]):
        self.decider = decider
        self.ctx = ctx
        self.load = load
        self.headers = headers
        self.status = 0
        self.outcome = ctx.outcome = RelayOutcome()
        endpoint = ctx.routed.endpoint if ctx.routed is not None else None
        if endpoint is not None and ctx.api.generates and ctx.reservation is not None:
            prompt_bound = decider.accounting.prompt_bound(ctx.model, endpoint.max_model_len)
            self.outcome.bound_usage(ctx.reservation.ticket.output_tokens, prompt_bound)
        facts = ctx.facts
        if facts.stream and decider.hooks.want_first_token:
            self.outcome.on_first_token = partial(decider.hooks.first_token, ctx)
        served = endpoint.served_model if endpoint is not None else ctx.model
        self._swap = (
            None if served == ctx.model else (b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(ctx.model))
        )
        self._pending = EventBuffer()
        self._unary = bytearray()

    def response_headers(self, status: int, headers: dict[str, str]) -> list[tuple[str, str]]:
        self.status = status
        return self.headers

    def body_chunk(self, chunk: bytes, end_of_stream: bool) -> bytes:
        facts = self.ctx.facts
        if self.status != 200:
            self._unary += chunk  # an engine's error: passed on as it is, read at the end
            return chunk
        if not facts.stream:
            self._unary += chunk
            if not end_of_stream:
                return b""  # held: the whole answer is rewritten (model name) and read (usage) at once
            return self._unary_answer()
        try:
            events = self._pending.feed(chunk)
        except EventTooLarge:  # not an engine's stream: passed on as it is, nothing more read from it
            self.outcome.broken = True
            return chunk
        if end_of_stream:
            last = self._pending.rest()
            events += [last] if last.strip() else []
        if not events:
            return b""
        prompt_tokens = facts.prompt_tokens + facts.output_reservation
        return relay_events(events, self.outcome, self.load, self._swap, facts.include_usage, prompt_tokens)

    def _unary_answer(self) -> bytes:
        data = bytes(self._unary)
        now = time.perf_counter()
        self.outcome.first_token_at_s = self.outcome.last_token_at_s = now
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if isinstance(parsed, dict):
            usage = Usage.from_chat(parsed.get("usage"))  # read as the HTTP gateway's relay reads it
            if usage is not None:
                self.outcome.usage = usage
            if self._swap is not None and "model" in parsed:
                parsed["model"] = self.ctx.model
                data = orjson.dumps(parsed)
        self.load.first_token(self.outcome.usage.total_tokens if self.outcome.usage else 0)
        return data

    def finish(self, complete: bool, served: str | None, observed: bool = True) -> None:
        """The response ended (or Envoy cut the stream): the load, the hooks, the reservation, the
        record, each exactly once (the exchange calls this once). Unobserved (no response body comes
        to the picker), a 200 is charged its whole reservation: the only count there is."""
        ctx, accounting = self.ctx, self.decider.accounting
        self.decider.open -= 1
        self.load.end()
        self.decider.hooks.ended(ctx)
        if served and ctx.routed is not None and served != host_port(ctx.routed.endpoint):
            ctx.record.endpoint = served  # Envoy retried elsewhere: the record names who served
        reservation = ctx.reservation
        if not observed and self.status in (0, 200):
            usage = reservation.settle_reserved() if reservation is not None else Usage(ctx.facts.prompt_tokens, 0)
            accounting.unobserved(ctx, usage)
        elif not complete:
            accounting.aborted(ctx)  # counts what was relayed, settles in a task of its own
        elif self.status != 200:
            error = EngineRejected(self.status, bytes(self._unary))
            accounting.failed(ctx, error)
            if reservation is not None:
                reservation.settle_soon(Usage(), 0)
        elif reservation is not None:
            accounting.settle_soon(ctx)  # the HTTP walk's rule: an unreadable usage charges the reservation
        else:
            accounting.fill(ctx, self.outcome)
        accounting.finish(ctx)

"""The endpoint picker's decision: the HTTP gateway's walk, without the relay (Envoy relays).

    arrive (Envoy's headers) -> intake (the walk's: parse, validate, authenticate, resolve, count)
    -> admit (the director's: context fits, reserve) -> prepare hooks -> route on the model's pools,
       only among the endpoints the data plane allows (`x-gateway-destination-endpoint-subset`)
    -> gate hooks (the SLO gate may queue, or refuse) -> commit (record, prefix index, session,
       dispatched hooks) -> Picked: the endpoint as `ip:port`, the body Envoy sends on (the served
       model name, stream usage on, engine shaping, the client's engine-control fields dropped unless
       its tenant may set them, the tier's priority), or the client's own bytes when none of that
       changed anything

and then `Following` watches the response Envoy streams back: the SSE events as the HTTP gateway's
relay reads them (first token for the hooks and the predictor, usage, tokens counted, the usage
chunk dropped when the client did not ask for it, the model name back to the public one), and at
the end (or when the stream is cut) it settles the reservation exactly once and hands the record
to the sinks (metrics, ledger), as the HTTP gateway does.

Every "no" is an immediate response in the API's own error shape: 4xx for the client's mistakes,
429 for limits and budgets (and for a request the SLO policy sheds), 503 when no endpoint (of the
allowed subset) can serve or the SLO gate refuses. Fallbacks to another model are not taken: the
request belongs to the InferencePool Envoy routed it to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection, Mapping, Sequence
from functools import partial
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from backends.fleet import Fleet, Pool
from backends.types import Endpoint, LoadTicket
from gateway.epp.exchange import Picked, Refused
from gateway.errors import EngineRejected, GatewayError, InvalidRequest, NoHealthyBackend
from gateway.request.accounting import Accounting
from gateway.request.apis import APIS, Api
from gateway.request.context import RequestContext, Routed
from gateway.request.detour import Detour
from gateway.request.director import Director
from gateway.request.dispatch import Dispatch
from gateway.request.hooks import Hooks
from gateway.request.intake import Intake
from gateway.request.record import RequestRecord
from gateway.telemetry.tracing import NOOP_TRACE, RequestTrace
from gateway.upstream.relay import RelayOutcome, relay_events
from policies.routing.types import RouteRequest
from policies.types import Usage

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
    def __init__(
        self,
        *,
        intake: Intake,
        director: Director,
        dispatch: Dispatch,
        accounting: Accounting,
        hooks: Hooks,
        fleet: Fleet,
        start_trace: Any = None,
    ) -> None:
        self.intake = intake
        self.director = director
        self.dispatch = dispatch
        self.accounting = accounting
        self.hooks = hooks
        self.fleet = fleet
        self.start_trace = start_trace
        self.open = 0  # requests picked whose response has not ended

    async def decide(self, headers: dict[str, str], body: bytes, subset: Sequence[str] | None) -> Picked | Refused:
        path = headers.get(":path", "").split("?", 1)[0]
        kind = API_BY_PATH.get(path)
        request_id = headers.get("x-request-id") or os.urandom(16).hex()
        if kind is None:
            error = InvalidRequest(f"the endpoint picker serves {', '.join(API_BY_PATH)}, not {path!r}")
            error.status = 404
            return refused_from(None, error, [("x-request-id", request_id)])
        ctx = self._arrive(headers, APIS[kind], request_id)
        try:
            return await self._walk(ctx, headers, body, subset)
        except Detour as detour:
            await self.accounting.release(ctx)
            return self._refuse(ctx, detour.error)
        except GatewayError as error:
            await self.accounting.release(ctx)
            return self._refuse(ctx, error)
        except asyncio.CancelledError:  # Envoy gave up on the stream while we decided
            self.accounting.aborted(ctx)
            self.accounting.finish(ctx)
            raise
        except Exception as exc:  # a bug still answers, in the API's shape, and leaves its record
            log.exception("endpoint picker: request %s failed unexpectedly", request_id)
            await self.accounting.close_open(ctx)
            return self._refuse(ctx, GatewayError(f"internal error: {type(exc).__name__}"))

    def _arrive(self, headers: Mapping[str, str], api: Api, request_id: str) -> RequestContext:
        record = RequestRecord(request_id=request_id, api=api.kind, started_at_unix_s=time.time())
        trace: RequestTrace = self.start_trace(request_id, headers) if self.start_trace else NOOP_TRACE
        return RequestContext(None, api, record, trace, time.perf_counter(), [("x-request-id", request_id)])

    async def _walk(
        self, ctx: RequestContext, headers: Mapping[str, str], body: bytes, subset: Sequence[str] | None
    ) -> Picked:
        facts = ctx._facts = await self.intake.facts(ctx, body, CIMultiDictProxy(CIMultiDict(headers)))
        ctx.model = facts.model
        ctx.routing = RouteRequest(facts)
        await self.director.admit(ctx)
        await self.hooks.prepare(ctx)
        pools = self.fleet.pools_for_model(ctx.model)
        exclude = _outside(pools, subset)
        with ctx.trace.span("routing", model=ctx.model):
            routed = self.dispatch.route(ctx, pools, exclude)
        if routed is None:
            raise NoHealthyBackend(
                f"No healthy endpoint can serve '{ctx.model}' right now"
                + (" among those the gateway allowed." if subset is not None else "."),
                headers=[("retry-after", str(self.dispatch.server.retry_after_s))],
            )

        def reroute(more: Collection[str], pools: Sequence[Pool] = pools) -> Routed | None:
            return self.dispatch.route(ctx, pools, exclude.union(more))

        routed = await self.hooks.gate(ctx, routed, reroute)
        self.dispatch.commit(ctx, routed)
        endpoint = routed.endpoint
        upstream_body = self.dispatch.upstream_body(ctx, endpoint)
        # Envoy forwards only what the picker sends back: the walk's body, engine-control fields as
        # policy allows. One the walk left as it was (nothing dropped, renamed or added) goes byte for byte.
        changed = bool(ctx.dropped_fields) or upstream_body != facts.body
        upstream = orjson.dumps(upstream_body) if changed else body
        local_prefill = max(facts.prompt_tokens - routed.decision.cached_tokens_estimate, 0)
        follower = Following(
            self, ctx, endpoint.inflight.begin(local_prefill), self.dispatch.response_headers(ctx, routed.decision)
        )
        ctx.record.gateway_overhead_s = time.perf_counter() - ctx.arrived_s
        self.open += 1
        added = [("x-request-id", ctx.record.request_id)]
        return Picked([host_port(endpoint)], upstream, follower, headers=added, body_changed=changed)

    def _refuse(self, ctx: RequestContext, error: GatewayError) -> Refused:
        self.accounting.failed(ctx, error)
        self.accounting.finish(ctx)
        return refused_from(ctx, error, ctx.headers)


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
        facts = ctx.facts
        if facts.stream and decider.hooks.want_first_token:
            self.outcome.on_first_token = partial(decider.hooks.first_token, ctx)
        endpoint = ctx.routed.endpoint if ctx.routed is not None else None
        served = endpoint.served_model if endpoint is not None else ctx.model
        self._swap = (
            None if served == ctx.model else (b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(ctx.model))
        )
        self._pending = b""
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
        self._pending += chunk
        if end_of_stream:
            events, self._pending = [self._pending] if self._pending.strip() else [], b""
        elif b"\n\n" in self._pending:
            *events, self._pending = self._pending.split(b"\n\n")
        else:
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
            usage = parsed.get("usage")
            if isinstance(usage, dict):
                details = usage.get("prompt_tokens_details") or {}
                self.outcome.usage = Usage(
                    prompt_tokens=int(usage.get("prompt_tokens") or 0),
                    completion_tokens=int(usage.get("completion_tokens") or 0),
                    cached_tokens=int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
                )
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
        else:
            accounting.fill(ctx, self.outcome)
            if reservation is not None:
                reservation.settle_soon(self.outcome.usage, self.outcome.counted_completion_tokens)
        accounting.finish(ctx)

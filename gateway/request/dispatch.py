"""Dispatch: one model's attempt at serving the request.

    route → gate → commit → send → on a failure before the first byte, again on another endpoint

`turn` routes and asks the gate (its one call site: every path that may send, a preempted stream's
new turn included, comes through it); `commit` tells the record, the router (prefix index, session)
and the dispatched hooks where the request goes; the `Transport` (`transport.py`) sends it and
answers whoever asked. A send that fails before anything reached the client is tried again on
another endpoint of the model (`server.upstream_retries` times; on the same one too when it only lacked
the request's LoRA adapter, which the retry loads again: `adapter_lost`); when none could serve, a
`Detour("upstream_error")` hands the request back to the director's fallback chain.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import TypeVar

from backends.fleet import Fleet, Pool
from backends.lora import LoraAdapter, budget_bytes, too_large
from backends.types import Endpoint
from gateway.app.settings import ServerSettings
from gateway.errors import InvalidRequest, NoHealthyBackend, UpstreamError
from gateway.request.context import RequestContext, Routed
from gateway.request.detour import Detour
from gateway.request.hooks import OPEN_GATE, Gate, Hooks
from gateway.request.transport import NotSent, Transport
from policies.routing.types import Router

A = TypeVar("A")


class Dispatch:
    def __init__(
        self, *, server: ServerSettings, fleet: Fleet, router: Router, hooks: Hooks, gate: Gate = OPEN_GATE
    ) -> None:
        self.server = server
        self.fleet = fleet
        self.router = router
        self.hooks = hooks
        self.gate = gate  # the waiting room and its checks (gateway/flow/gate.py): asked in `turn` only

    async def serve(self, ctx: RequestContext, transport: Transport[A]) -> A:
        """Serve on `ctx.model` (its reservation held) through `transport`, or raise `Detour("upstream_error")`."""
        pools = self.fleet.pools_for_model(ctx.model)
        adapter = self.fleet.adapter(ctx.model)
        if adapter is not None:  # only the pools whose LoRA memory budget can hold it (else a 400)
            pools = fitting_pools(adapter, pools)
        if ctx.routing is not None:  # a LoRA adapter routes (and hashes its prefix) as itself
            ctx.routing.use_adapter(adapter)
        exclude = transport.unreachable(pools)
        scoped = bool(exclude)
        retries = self.server.upstream_retries
        attempts, detail = 0, ""
        crashes, crash_detail = 0, ""  # engines that failed on this request's content
        for _ in range(1 + retries):
            routed = await self.turn(ctx, pools, exclude)
            if routed is None:
                break
            attempts += 1
            self.commit(ctx, routed)
            # the last try waits for the engine: no other endpoint would take it
            last = attempts > retries or not _others(pools, exclude, routed.endpoint)
            try:
                return await transport.send(ctx, routed, last=last)
            except NotSent as failed:
                if failed.fault != "adapter_lost":  # else the retry may go there again: it reloads the adapter
                    exclude.add(routed.endpoint.id)
                detail = failed.detail
                ctx.outcome = None  # nothing reached the client: this attempt is not charged
                if failed.fault == "request" and failed.error is not None:  # so it is everywhere
                    raise Detour("upstream_error", failed.error, fallback=False) from None
                if failed.fault == "crash":
                    crashes, crash_detail = crashes + 1, detail
                    if crashes >= 2:  # the request made two engines fail: it is the request
                        raise Detour("upstream_error", _crashed(ctx.model, crashes, detail), fallback=False) from None
        if attempts == 0:
            where = " among those the data plane allows." if scoped else "."
            error: NoHealthyBackend | UpstreamError = NoHealthyBackend(
                f"No healthy endpoint can serve '{ctx.model}' right now{where}",
                headers=[("retry-after", str(self.server.retry_after_s))],
            )
        elif crashes:  # an engine failed on it: never walked down the fallback chain
            raise Detour("upstream_error", _crashed(ctx.model, crashes, crash_detail), fallback=False)
        else:
            error = UpstreamError(f"The upstream failed for '{ctx.model}': {detail}")
        raise Detour("upstream_error", error)

    async def turn(self, ctx: RequestContext, pools: Sequence[Pool], exclude: Collection[str]) -> Routed | None:
        """Route on `pools` avoiding `exclude`, then ask the gate: the attempt to commit, or None
        when no endpoint can take it (the gate may hold it first, or raise `Detour`)."""
        with ctx.trace.span("routing", model=ctx.model):
            routed = self.route(ctx, pools, exclude)

        def reroute(more: Collection[str]) -> Routed | None:
            return self.route(ctx, pools, {*exclude, *more})

        return await self.gate.admit(ctx, routed, reroute)

    def route(self, ctx: RequestContext, pools: Sequence[Pool], exclude: Collection[str]) -> Routed | None:
        assert ctx.routing is not None
        now = time.monotonic()
        for pool in pools:
            decision = self.router.route(ctx.routing, pool, now, exclude)
            if decision is not None:
                return Routed(pool, decision)
        return None

    def commit(self, ctx: RequestContext, routed: Routed) -> None:
        """The walk goes with `routed`: the record, the router (prefix index, session) and the
        dispatched hooks (route metrics among them) hear of it."""
        ctx.routed = routed
        record, decision = ctx.record, routed.decision
        endpoint = decision.endpoint
        record.pool, record.endpoint, record.route_reason = routed.pool.name, endpoint.id, decision.reason
        if ctx.reservation is not None:  # settled at the serving pool's price (policies.yaml `pool_prices`)
            ctx.reservation.pool = routed.pool.name
        record.engine = endpoint.engine
        adapter = self.fleet.adapter(ctx.model)  # a LoRA adapter is served under its own name
        record.served_model = adapter.name if adapter is not None else endpoint.served_model
        record.pd_reason = decision.pd_reason
        record.prefill_endpoint = decision.prefill_endpoint.id if decision.prefill_endpoint is not None else ""
        record.upstream_attempts += 1
        assert ctx.routing is not None
        self.router.on_dispatch(ctx.routing, decision)
        self.hooks.dispatched(ctx)


def fitting_pools(adapter: LoraAdapter, pools: Sequence[Pool]) -> list[Pool]:
    """The pools whose replicas' LoRA memory budget (`lora_memory_budget_mb`) can hold `adapter`; an
    adapter larger than every one is the request's dead end (400 naming it, no fallback: the policy
    serves it where it cannot fit, which no other replica changes)."""
    budgets = [(pool.name, budget_bytes(pool.config.lora_memory_budget_mb)) for pool in pools]
    refusal = too_large(adapter, budgets)
    if refusal is not None:
        raise Detour("upstream_error", InvalidRequest(refusal, param="model", code="adapter_too_large"), fallback=False)
    size = adapter.size_bytes
    return [
        pool
        for pool, (_name, budget) in zip(pools, budgets, strict=True)
        if budget is None or not size or size <= budget
    ]


def _others(pools: Sequence[Pool], exclude: Collection[str], endpoint: Endpoint) -> bool:
    """Whether an endpoint besides `endpoint` (and those tried) could take the request (asked on
    every send: no `servable()` list built per pool)."""
    return any(pool.serves_besides(endpoint, exclude) for pool in pools)


def _crashed(model: str, crashes: int, detail: str) -> UpstreamError:
    """The answer to a request that made engines fail (a 5xx with an error body): not retried further,
    not sent to a fallback model, and the client's SDK is told not to send it again."""
    where = "two replicas" if crashes > 1 else "its replica"
    return UpstreamError(
        f"The engine serving '{model}' failed on this request on {where}; it was not retried further: {detail}",
        headers=[("x-should-retry", "false")],
    )

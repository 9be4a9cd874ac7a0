"""What one request carries as it walks, and the seams through which everything else plugs into the
walk: the context, the hooks and the gate, the transport, admission and the record sinks. One module
because each seam is a protocol over the context: a feature, a transport or a store reads the
context's typed fields and implements one protocol here, and the walk (`gateway/request/`) imports
none of them (an import contract in pyproject.toml checks it: the app factory builds and hands them in).

The context
-----------

One request's state as it walks: what the director, its stages and the hooks read and write.
Typed fields, no string-keyed side channel: a hook that needs per-request state names it here (and
says which phase writes it), so every reader sees its type and where it comes from.

Hooks: features that follow a request through the walk, one method per phase; and the gate
------------------------------------------------------------------------------------------

The walk (`gateway/request/`) names the phases and owns none of the features; a feature (the SLO
objectives, the predictor's learning, the engine tokenizer, ...) subclasses `Hook`, overrides
the phases it needs, and is put in the hook list the app factory builds (`gateway/app/factory.py`). The walk
imports no hook module (an import contract checks it).

Phases, in the order one request meets them:

    prepare(ctx)                 async, once per model of the fallback chain, before routing on it:
                                 fill the routing inputs (`ctx.routing`); it never waits
    dispatched(ctx)              sync, the walk committed to `ctx.routed` (once per attempt)
    first_token(ctx, at_s)       sync, a stream's first token was relayed (perf_counter time)
    ended(ctx)                   sync, that attempt's upstream call ended: success, failure, abort
                                 (exactly once after each `dispatched`)
    finished(ctx)                sync, once per request, after its record is filled, before sinks

Hooks observe; none decides whether the request may go. That is the `Gate`'s: the walk asks it once
per attempt, after routing and before anything is sent (`Gate.admit`: the route to go on, after
waiting if need be; cancellable; or a `Detour`). The app's gate is the waiting room and its checks
(`gateway/flow/gate.py`); `OPEN_GATE` lets everything through at once. A hook's own failure in a
sync phase is logged and does not break the request or the other hooks; `prepare` and the gate are
part of the decision, so their exceptions (a `Detour` above all) propagate.

The transport seam: where a routed request goes, and how its answer reaches whoever asked
-----------------------------------------------------------------------------------------

The walk (`gateway/request/director.py`'s dispatch) decides — route, gate, commit — and then hands
the request to a `Transport`, as httpx's client hands a request to its transport: `send(ctx, routed)`
returns the answer in the shape its caller takes. One walk serves every way a request arrives and
every place it can go:

- `gateway/transport/engine.py`: relays to an engine over HTTP (the PD prefill leg and stream
  migration beside it) and answers the client with an aiohttp response;
- `gateway/epp/decide.py`: answers Envoy with the pick (Envoy sends the request itself) and
  follows the response Envoy streams back;
- `gateway/batch/lines.py`: answers a batch line in process, to the batch runner.

An upstream of another kind (a hosted provider's own API: Anthropic, Bedrock, Gemini) is one more
`Transport`: it writes its request from the facts and the routing decision, reads its answer back
and keeps the walk's contract below; the walk does not change.

The contract, for a transport that sends (`follows` False):
- the attempt is committed (`ctx.routed`, the dispatched hooks) before `send`; `send` calls the
  `ended` hooks exactly once, whatever happens, and settles the reservation once anything reached
  an engine (`Accounting.settle`, or `settle_unused` for an engine's own refusal);
- it raises `NotSent` when it failed before anything reached the client, so the walk may try
  another endpoint (`last` True: none is left, wait for the engine rather than give up early).
A transport whose answer outlives the walk (`follows` True: the endpoint picker, where Envoy
streams the response after the pick) ends the attempt, settles and hands the record to the sinks
itself when that answer ends; the director leaves the request open.

The walk imports no transport: the app factory builds them and hands them in (an import contract
keeps `gateway.request` from importing `gateway.transport`).

Admission and the record sinks
------------------------------

The other parts the walk of a request calls, as small protocols: the walk never asks which kind it
holds. (Tracing's protocol and its no-op live in `gateway.telemetry.tracing`.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal, Protocol, TypeVar, cast

from aiohttp import web

from backends.fleet import Pool
from backends.types import Endpoint
from gateway.errors import GatewayError
from gateway.request.record import RequestRecord
from gateway.telemetry.tracing import RequestTrace
from gateway.upstream.relay import RelayOutcome
from policies.limits.admission import Admitted
from policies.routing.types import RouteDecision, RouteRequest
from policies.slo import Miss
from policies.types import Rejection, RequestFacts, Usage
from predictor.features import Prediction
from predictor.prior import OutputPrediction

if TYPE_CHECKING:
    from gateway.request.accounting import Reservation
    from gateway.request.apis import Api


class FairnessLease(Protocol):
    """A dispatch's fairness account in the waiting room (`gateway/flow/queue.py`'s `Lease`)."""

    def finished(self, actual_cost_tokens: float | None) -> None: ...


@dataclass(slots=True)
class Routed:
    """A routing decision on one pool: where the request would go."""

    pool: Pool
    decision: RouteDecision

    @property
    def endpoint(self) -> Endpoint:
        return self.decision.endpoint


@dataclass(slots=True)
class RequestContext:
    """Written by the stage (or phase) each comment names; read by anything after it."""

    http: web.Request | None  # None: in the endpoint picker (Envoy holds the client's connection), or a batch line
    api: Api  # the API the client called (shared for native kinds, per request for translated ones)
    record: RequestRecord  # filled as the request walks, handed to the sinks once (accounting)
    trace: RequestTrace
    arrived_s: float  # perf_counter at arrival
    headers: list[tuple[str, str]]  # carried by every answer: x-request-id, x-tokenway-fallback
    # intake: the request's frozen facts; anything after it reads them. A plain field, not a checked
    # property: the walk reads it a few dozen times per request. None (typed away) until intake ran:
    # `has_facts` says whether it has (a record of a request refused at intake has none)
    facts: RequestFacts = field(default=cast("RequestFacts", None), repr=False)
    engine_fields: tuple[str, ...] = ()  # intake: engine-control fields the caller's tenant may set
    dropped_fields: tuple[str, ...] = ()  # intake: the client's engine-control fields it dropped
    routing: RouteRequest | None = None  # director (prepare hooks fill its routing inputs)
    model: str = ""  # director: the model of the chain being tried
    reservation: Reservation | None = None  # director: admission's ticket for `model`
    routed: Routed | None = None  # dispatch: the attempt committed to (after the gate let it go)
    prediction: Prediction | None = None  # dispatched hooks: the serving endpoint's, made before it ran
    gate_wait_s: float = 0.0  # the gate: time the request was held before dispatch (its waiting room)
    unforwarded_fields: tuple[str, ...] = ()  # dispatch (on debug): request fields that did not reach the engine
    output_prediction: OutputPrediction | None = None  # the gate (flow control): learnt against at the end
    # the gate: the dispatch its tenant's fairness counter is charged for, until that attempt ends
    flow_lease: FairnessLease | None = None
    flow_running_since_s: float | None = None  # flow control's dispatched hook: a stream it may cut, since (monotonic)
    slo_miss: Miss | None = None  # the SLO check: its last miss while the request waits (None: not waiting on it)
    outcome: RelayOutcome | None = None  # dispatch: the upstream call under way or done (None: none began)
    # dispatch: endpoints that answered this request 5xx; counted against them only if another serves it
    answered_5xx: list[Endpoint] = field(default_factory=list)

    @property
    def has_facts(self) -> bool:
        return cast("RequestFacts | None", self.facts) is not None

    def render_error(self, error: GatewayError, headers: Iterable[tuple[str, str]]) -> web.Response:
        """`error` in the shape of the API the client called."""
        return self.api.render_error(error, headers)


log = logging.getLogger("tokenway.request.hooks")

Reroute = Callable[[Collection[str]], Routed | None]  # route again on the model, excluding these endpoints


class Gate(Protocol):
    """May the request go now, and where: the one place the walk asks (see the module docstring)."""

    async def admit(self, ctx: RequestContext, routed: Routed | None, reroute: Reroute) -> Routed | None:
        """The route to dispatch on (`routed`, or one from `reroute(exclude)`), after waiting if need
        be; None when `routed` is None and nothing is worth waiting for; or raise `Detour`."""
        ...


class OpenGate:
    """A gate that holds nothing: every route goes at once (the walk without flow control)."""

    async def admit(self, ctx: RequestContext, routed: Routed | None, reroute: Reroute) -> Routed | None:
        return routed


OPEN_GATE: Final = OpenGate()


class Hook:
    """A feature of the walk. Every phase is a no-op here: override the ones the feature needs."""

    async def prepare(self, ctx: RequestContext) -> None:
        return None

    def dispatched(self, ctx: RequestContext) -> None:
        return None

    def first_token(self, ctx: RequestContext, at_s: float) -> None:
        return None

    def ended(self, ctx: RequestContext) -> None:
        return None

    def finished(self, ctx: RequestContext) -> None:
        return None


def _overrides(hook: Hook, phase: str) -> bool:
    return getattr(type(hook), phase) is not getattr(Hook, phase)


class Hooks:
    """The app's hooks, sorted by phase once at start-up: a phase nobody overrides costs nothing."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.all = tuple(hooks)
        self._prepare = [h for h in self.all if _overrides(h, "prepare")]
        self._dispatched = [h for h in self.all if _overrides(h, "dispatched")]
        self._first_token = [h for h in self.all if _overrides(h, "first_token")]
        self._ended = [h for h in self.all if _overrides(h, "ended")]
        self._finished = [h for h in self.all if _overrides(h, "finished")]

    @property
    def want_first_token(self) -> bool:
        return bool(self._first_token)

    async def prepare(self, ctx: RequestContext) -> None:
        for hook in self._prepare:
            await hook.prepare(ctx)

    def dispatched(self, ctx: RequestContext) -> None:
        for hook in self._dispatched:
            try:
                hook.dispatched(ctx)
            except Exception:  # one feature's bug must not cost the request or the other hooks
                log.exception("hook %s failed in dispatched", type(hook).__name__)

    def first_token(self, ctx: RequestContext, at_s: float) -> None:
        for hook in self._first_token:
            try:
                hook.first_token(ctx, at_s)
            except Exception:
                log.exception("hook %s failed in first_token", type(hook).__name__)

    def ended(self, ctx: RequestContext) -> None:
        for hook in self._ended:
            try:
                hook.ended(ctx)
            except Exception:
                log.exception("hook %s failed in ended", type(hook).__name__)

    def finished(self, ctx: RequestContext) -> None:
        for hook in self._finished:
            try:
                hook.finished(ctx)
            except Exception:
                log.exception("hook %s failed in finished", type(hook).__name__)


A = TypeVar("A", covariant=True)  # the answer a transport gives its caller

Fault = Literal["endpoint", "request", "crash", "adapter_lost", "gateway"]


class NotSent(Exception):
    """A send failed before anything reached the client. `fault` says whose failure it was: the
    endpoint's (try another), the request's (`error` is the answer, everywhere), a crash of the
    engine on this request's content (a second one ends the walk: `gateway/upstream/engine_errors.py`),
    `adapter_lost`: the endpoint no longer held the request's LoRA adapter, which the next send there
    loads again, so that endpoint stays a candidate for the retry (the only replica of a pool included),
    or the gateway's own (`error` is the answer: it ran out of file descriptors, so every endpoint and
    every fallback would fail the same way, and no endpoint is blamed)."""

    def __init__(self, detail: str, *, fault: Fault = "endpoint", error: GatewayError | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fault = fault
        self.error = error


class Transport(Protocol[A]):
    @property
    def follows(self) -> bool:
        """The answer outlives the walk: this transport settles and finishes the request itself."""
        ...

    def unreachable(self, pools: Sequence[Pool]) -> set[str]:
        """Ids of the endpoints this transport cannot send to (the endpoint picker's: those outside
        the subset Envoy allows); routing avoids them. A fresh set: the walk adds what it tried."""
        ...

    async def send(self, ctx: RequestContext, routed: Routed, *, last: bool) -> A:
        """Send the committed attempt; the answer for the caller, or `NotSent`."""
        ...

    def refuse(self, ctx: RequestContext, error: GatewayError, headers: Iterable[tuple[str, str]]) -> A:
        """`error` answered to the caller, in the shape of the API it called."""
        ...


class AdmissionPort(Protocol):
    """`policies.limits.admission.Admission`'s contract as the walk uses it: `admit`, then exactly one
    of `settle` or `release` per `Admitted` ticket."""

    async def admit(self, facts: RequestFacts, model: str, now: float | None = None) -> Admitted | Rejection: ...

    async def settle(
        self,
        ticket: Admitted,
        usage: Usage | None,
        *,
        model: str,
        charged_output_tokens: int | None = None,
        pool: str | None = None,
    ) -> None: ...

    async def release(self, ticket: Admitted) -> None: ...

    def settle_soon(
        self,
        ticket: Admitted,
        usage: Usage | None,
        *,
        model: str,
        charged_output_tokens: int | None = None,
        pool: str | None = None,
    ) -> object:
        """`settle` begun now and finished in the background (the walk does not wait for the store);
        `pool`, the pool that served it, picks its price (`pool_prices`)."""

    def release_soon(self, ticket: Admitted) -> object:
        """`release` begun now and finished in the background."""


class RecordSink(Protocol):
    """Receives every finished request exactly once (metrics, ledger)."""

    def observe(self, record: RequestRecord) -> None: ...

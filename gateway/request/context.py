"""One request's state as it walks: what the director, its stages and the hooks read and write.

Typed fields, no string-keyed side channel: a hook that needs per-request state names it here (and
says which phase writes it), so every reader sees its type and where it comes from.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from aiohttp import web

from backends.fleet import Pool
from backends.types import Endpoint
from gateway.errors import GatewayError
from gateway.request.record import RequestRecord
from gateway.telemetry.tracing import RequestTrace
from gateway.upstream.relay import RelayOutcome
from policies.routing.types import RouteDecision, RouteRequest
from policies.slo import Miss
from policies.types import RequestFacts
from predictor.length import OutputPrediction
from predictor.types import Prediction

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

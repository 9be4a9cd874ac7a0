"""Where batch lines run right now, and how many more may start: the runner's one question.

`BatchLoad` counts this process's batch lines: per endpoint once routed (the walk's batch gate puts
them there), per model while they are still on their way (read, counted, admitted), and per endpoint
the line last placed there while it is predicted to be prefilling (`spare.paced_starts`). `BatchCapacity`
answers "may batch run now on this pool, and how many lines" from the endpoints' state, the lines
already placed and the interactive requests waiting for the pool (`policies.batch`).

## The gate's check (`BatchGate`)

Batch spare capacity: the gate's check that keeps batch lines on spare capacity.

For a batch line (`facts.batch_id`), each time the gate asks (`gateway/flow/gate.py`): the route's
endpoint must have room for one more batch line (`policies.batch.endpoint_spare`: no interactive
request waiting for the pool, no engine queue, KV not too full, under the per-endpoint batch cap, no
other batch line still in its predicted prefill there (`spare.paced_starts`), and — where the pool
has SLO classes and the predictor predicts — the line's predicted TTFT and TPOT within
`slo_headroom` of the tightest interactive objective). If it has not, the check `Avoid`s it (the
room routes again among the others); when none has, or interactive requests wait for the pool, it
refuses: 503 `batch_no_spare_capacity`, which the batch runner reads as "later" (the line is claimed
again shortly; nothing is charged: the reservation is released). A batch line never waits for spare
capacity. Other requests pass untouched, at the cost of one attribute test.

The check also keeps `BatchLoad` in step: a line counts on its endpoint from the gate's yes to the
attempt's end (its hook's `ended`), and as prefilling there until its predicted TTFT has passed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.fleet import Fleet
from gateway.batch.lines import NO_SPARE_CAPACITY
from gateway.errors import Rejected
from gateway.flow.checks import PredictsLatency
from gateway.flow.gate import GO, Avoid, Check, Refuse, Turn, Verdict
from gateway.request import Detour, Hook, RequestContext, Routed
from policies.batch import LinePrediction, Objectives, SpareLimits, endpoint_spare, pool_spare_slots, tightest
from policies.holder import PolicyHolder
from policies.types import Rejection
from predictor.features import RequestShape

Waiting = Callable[[str], int]  # pool -> interactive requests waiting for it in the gateway


def _nobody_waits(pool: str) -> int:
    return 0


@dataclass(slots=True)
class _Line:
    model: str
    endpoint: str | None = None  # where it runs now (None: not routed, or between attempts)
    routed: bool = False


@dataclass(slots=True)
class BatchLoad:
    """This process's batch lines: on their way to a model's pools, or running on an endpoint."""

    by_endpoint: Counter[str] = field(default_factory=Counter)
    on_the_way: Counter[str] = field(default_factory=Counter)  # model -> started, not routed yet
    _lines: dict[str, _Line] = field(default_factory=dict)  # request id -> line
    # endpoint -> (until when, monotonic s, its last placed line is predicted to prefill; that line)
    _prefilling: dict[str, tuple[float, str]] = field(default_factory=dict)

    def started(self, request_id: str, model: str) -> None:
        self._lines[request_id] = _Line(model)
        self.on_the_way[model] += 1

    def is_batch(self, request_id: str) -> bool:
        return request_id in self._lines

    def routed(self, request_id: str) -> bool:
        """The walk's batch gate has placed this line on an endpoint (at least once)."""
        line = self._lines.get(request_id)
        return line is not None and line.routed

    def placed(self, request_id: str, endpoint_id: str, prefill_until_s: float | None = None) -> None:
        """The walk routed the line to `endpoint_id` (each attempt); it is predicted to prefill there
        until `prefill_until_s` (monotonic; None: no prediction)."""
        line = self._lines.get(request_id)
        if line is None:
            return
        if not line.routed:
            line.routed = True
            self._arrived(line.model)
        self.left(request_id)
        line.endpoint = endpoint_id
        self.by_endpoint[endpoint_id] += 1
        if prefill_until_s is not None:
            self._prefilling[endpoint_id] = (prefill_until_s, request_id)

    def prefilling(self, endpoint_id: str, now_s: float) -> bool:
        """A batch line placed on `endpoint_id` is still within its predicted prefill."""
        found = self._prefilling.get(endpoint_id)
        if found is None:
            return False
        if found[0] <= now_s:
            del self._prefilling[endpoint_id]
            return False
        return True

    def left(self, request_id: str) -> None:
        """The line's attempt on its endpoint ended."""
        line = self._lines.get(request_id)
        if line is None or line.endpoint is None:
            return
        found = self._prefilling.get(line.endpoint)
        if found is not None and found[1] == request_id:  # an answer ends its prefill for sure
            del self._prefilling[line.endpoint]
        self.by_endpoint[line.endpoint] -= 1
        if self.by_endpoint[line.endpoint] <= 0:
            del self.by_endpoint[line.endpoint]
        line.endpoint = None

    def finished(self, request_id: str) -> None:
        line = self._lines.get(request_id)
        if line is None:
            return
        self.left(request_id)
        if not line.routed:
            self._arrived(line.model)
        del self._lines[request_id]

    def _arrived(self, model: str) -> None:
        self.on_the_way[model] -= 1
        if self.on_the_way[model] <= 0:
            del self.on_the_way[model]

    def running_on(self, endpoint_id: str) -> int:
        return self.by_endpoint.get(endpoint_id, 0)

    @property
    def lines(self) -> int:
        return len(self._lines)


@dataclass(slots=True)
class BatchCapacity:
    fleet: Fleet
    limits: SpareLimits
    load: BatchLoad = field(default_factory=BatchLoad)
    waiting: Waiting = _nobody_waits
    now: Callable[[], float] = time.monotonic

    def pool_slots(self, pool_name: str) -> int:
        """May batch run now on this pool: how many more lines it takes (0: not now)."""
        pool = self.fleet.pools.get(pool_name)
        if pool is None:
            return 0
        now, load = self.now(), self.load
        return pool_spare_slots(
            pool.servable(),
            self.limits,
            now,
            load.by_endpoint,
            self.waiting(pool_name),
            prefilling=lambda endpoint_id: load.prefilling(endpoint_id, now),
        )

    def model_slots(self, model: str) -> int:
        """Lines of `model` that may start now: its pools' free slots less the lines on their way."""
        slots = sum(self.pool_slots(pool.name) for pool in self.fleet.pools_for_model(model))
        return max(slots - self.load.on_the_way.get(model, 0), 0)


@dataclass(slots=True)
class BatchGate(Check, Hook):
    capacity: BatchCapacity
    policies: PolicyHolder
    predictor: PredictsLatency | None = None  # the line's own predictions where the router made none
    retry_after_s: float = 1.0
    _objectives: tuple[int, Objectives] = field(default=(-1, Objectives()))

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        ctx = turn.ctx
        if ctx.facts.batch_id is None:
            return GO
        endpoint = routed.endpoint
        reason = endpoint_spare(
            endpoint,
            self.capacity.limits,
            self.capacity.now(),
            self.capacity.load.running_on(endpoint.id),
            interactive_waiting=self.capacity.waiting(routed.pool.name),
            predicted=self._predicted(ctx, routed),
            objectives=self.objectives(),
            prefilling=self.capacity.load.prefilling(endpoint.id, self.capacity.now()),
        )
        if reason is None:
            return GO
        refuse = Refuse(self._no_spare(ctx))
        if reason == "interactive_waiting":
            return refuse
        return Avoid((endpoint.id,), refuse)

    def went(self, turn: Turn, routed: Routed) -> None:
        """The line goes: it counts on its endpoint, prefilling there until its predicted TTFT."""
        facts = turn.ctx.facts
        if facts.batch_id is None:
            return
        predicted = self._predicted(turn.ctx, routed)
        until = self.capacity.now() + predicted.ttft_ms / 1000.0 if predicted is not None else None
        self.capacity.load.placed(facts.request_id, routed.endpoint.id, until)

    def ended(self, ctx: RequestContext) -> None:
        if ctx.has_facts and ctx.facts.batch_id is not None:
            self.capacity.load.left(ctx.facts.request_id)

    def objectives(self) -> Objectives:
        """The tightest objectives of the policy's SLO classes (cached per policy generation)."""
        policy = self.policies.current
        generation = id(policy)
        if self._objectives[0] != generation:
            classes = policy.config.slo_classes.values()
            self._objectives = (generation, tightest(Objectives(c.ttft_ms, c.tpot_ms) for c in classes))
        return self._objectives[1]

    def _no_spare(self, ctx: RequestContext) -> Detour:
        rejection = Rejection(
            503,
            f"No endpoint of '{ctx.model}' has spare capacity for batch work now.",
            "server_error",
            NO_SPARE_CAPACITY,
            headers=(("retry-after", f"{self.retry_after_s:g}"),),
            reason=NO_SPARE_CAPACITY,
        )
        return Detour(NO_SPARE_CAPACITY, Rejected(rejection), fallback=False)

    def _predicted(self, ctx: RequestContext, routed: Routed) -> LinePrediction | None:
        objectives = self.objectives()
        if objectives.ttft_ms is None and objectives.tpot_ms is None:
            return None
        decision = routed.decision
        prediction = decision.prediction
        if prediction is None and self.predictor is not None:
            facts = ctx.facts
            shape = RequestShape(facts.prompt_tokens, facts.max_tokens, facts.principal.tenant, ctx.model)
            endpoints, cached = [decision.endpoint], [decision.cached_tokens_estimate]
            lower = [decision.cached_lower_tokens]
            prediction = self.predictor.predict(routed.pool.name, shape, endpoints, cached, lower_cached_tokens=lower)[
                0
            ]
        if prediction is None:
            return None
        return LinePrediction(prediction.ttft_ms, prediction.tpot_ms)

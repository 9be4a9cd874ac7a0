"""Batch spare capacity: the gate's check that keeps batch lines on spare capacity.

For a batch line (`facts.batch_id`), each time the gate asks (`gateway/flow/check.py`): the route's
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

from dataclasses import dataclass, field

from gateway.batch.capacity import BatchCapacity
from gateway.batch.lines import NO_SPARE_CAPACITY
from gateway.errors import Rejected
from gateway.flow.check import GO, Avoid, Check, Refuse, Turn, Verdict
from gateway.flow.slo import PredictsLatency
from gateway.request import Detour, Hook, RequestContext, Routed
from policies.batch import LinePrediction, Objectives, endpoint_spare, tightest
from policies.holder import PolicyHolder
from policies.types import Rejection
from predictor.types import RequestShape


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

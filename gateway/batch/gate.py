"""The batch gate: the walk's hook that keeps batch lines on spare capacity.

For a batch line (`facts.batch_id`), after each routing decision: the chosen endpoint must have room
for one more batch line (`policies.batch.spare.endpoint_spare`: no interactive request waiting for
the pool, no engine queue, KV not too full, under the per-endpoint batch cap, no other batch line
still in its predicted prefill there (`spare.paced_starts`), and — where the pool
has SLO classes and the predictor predicts — the line's predicted TTFT and TPOT within
`slo_headroom` of the tightest interactive objective). If it has not, the line is routed again among
the endpoints that have; if none has, the walk answers 503 `batch_no_spare_capacity`, which the
batch runner reads as "later" (the line is claimed again shortly; nothing is charged: the
reservation is released). Other requests pass untouched, at the cost of one attribute test.

The gate also keeps `BatchLoad` in step: a line counts on its endpoint from the gate's yes to the
attempt's end, and as prefilling there until its predicted TTFT has passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.batch.capacity import BatchCapacity
from gateway.batch.lines import NO_SPARE_CAPACITY
from gateway.errors import Rejected
from gateway.flow.slo import PredictsLatency
from gateway.request import Detour, Hook, RequestContext, Reroute, Routed
from policies.batch.spare import LinePrediction, Objectives, endpoint_spare, tightest
from policies.holder import PolicyHolder
from policies.types import Rejection
from predictor.types import RequestShape


@dataclass(slots=True)
class BatchGate(Hook):
    capacity: BatchCapacity
    policies: PolicyHolder
    predictor: PredictsLatency | None = None  # the line's own predictions where the router made none
    retry_after_s: float = 1.0
    _objectives: tuple[int, Objectives] = field(default=(-1, Objectives()))

    async def gate(self, ctx: RequestContext, routed: Routed, reroute: Reroute) -> Routed:
        facts = ctx.facts
        if facts.batch_id is None:
            return routed
        load = self.capacity.load
        pool = routed.pool
        tried: set[str] = set()
        candidate: Routed | None = routed
        while candidate is not None and candidate.pool is pool:
            endpoint = candidate.endpoint
            now = self.capacity.now()
            predicted = self._predicted(ctx, candidate)
            reason = endpoint_spare(
                endpoint,
                self.capacity.limits,
                now,
                load.running_on(endpoint.id),
                interactive_waiting=self.capacity.waiting(pool.name),
                predicted=predicted,
                objectives=self.objectives(),
                prefilling=load.prefilling(endpoint.id, now),
            )
            if reason is None:
                until = now + predicted.ttft_ms / 1000.0 if predicted is not None else None
                load.placed(facts.request_id, endpoint.id, until)
                return candidate
            tried.add(endpoint.id)
            if reason == "interactive_waiting":
                break
            candidate = reroute(tried)
        rejection = Rejection(
            503,
            f"No endpoint of '{ctx.model}' has spare capacity for batch work now.",
            "server_error",
            NO_SPARE_CAPACITY,
            headers=(("retry-after", f"{self.retry_after_s:g}"),),
            reason=NO_SPARE_CAPACITY,
        )
        raise Detour(NO_SPARE_CAPACITY, Rejected(rejection), fallback=False)

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
            prediction = self.predictor.predict(routed.pool.name, shape, endpoints, cached)[0]
        if prediction is None:
            return None
        return LinePrediction(prediction.ttft_ms, prediction.tpot_ms)

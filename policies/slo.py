"""The SLO gate's decision: can some endpoint meet this request's latency SLO?

Pure functions of (the request's effective SLO, the candidates' predictions, the tightest TPOT SLO
already running on each endpoint, the caller's priority). The gateway does the I/O around it:
parsing the headers, waiting in the queue, rendering the 503 (`gateway/flow/checks.py`).

What is compared. An endpoint *meets* the SLO, with the class's `compare`:

- `probability` (the default): when the predicted probability of meeting every target the SLO
  sets is at least `min_probability` (0.5 by default),

      P(TTFT <= ttft_ms - elapsed_ms) * P(TPOT <= min(tpot_ms, running_tpot_slo_ms[endpoint]))

  read from each prediction's median and p90 as a log-normal (`Prediction.within`; the request
  has already spent elapsed_ms). Attainment counts a rejected request as a miss for certain, so a
  request that would meet its SLO more often than not is worth serving: on the tight SLO benchmark
  (bench/results/predictor-tight.md) the p90 rule below served 99.9 % of what it admitted within
  the SLO but turned away a fifth of the traffic (and reached 78.2 % where no gate reached 82.9 %).
- `p90`: predicted_q(TTFT) <= ttft_ms - elapsed_ms and predicted_q(TPOT) <= min(tpot_ms,
  running floor) with q the p90: "meets with about 90 % probability" per target, the role of
  llm-d's quantile-0.9 prediction times its `sloBufferFactor`. For operators who would rather turn
  a request away than serve it late.
- `mean`: the same with the point estimate (the median): about `probability` at 0.5 per target.

Running requests are protected: the new request's predicted TPOT on an endpoint is the step time
everybody in that batch will see once it joins, so an endpoint whose prediction exceeds the
tightest TPOT SLO among the requests it already serves does not meet (llm-d's pod TPOT SLO,
`running_request_tpot_slo_queue.go`).

An idle endpoint (nothing running, waiting or in flight) always admits, as in llm-d's
`latency-slo-admitter`: the gate exists to keep requests from queueing behind load, and an idle
endpoint has none, so a miss there says the request is too big for its SLO (or the predictor is
pessimistic), and neither rejecting nor waiting would help anybody. It is also the gate's safety
valve: a predictor that over-predicts could otherwise reject everything, and a fleet that serves
nothing teaches it nothing.

On a miss, sheddable principals (priority < 0) are shed at once whatever the class says: the
capacity that remains goes to the traffic that cannot be dropped. Otherwise the class's `on_miss`
applies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from policies.schema import DEFAULT_MAX_QUEUE_MS, DEFAULT_MIN_PROBABILITY, MissAction, SloClassConfig
from predictor.features import Feature, Prediction, Target

Compare = Literal["probability", "p90", "mean"]
Action = Literal["fallback", "queue", "reject", "shed", "proceed"]


@dataclass(frozen=True, slots=True)
class Slo:
    """A latency objective and its miss policy: a compiled `slo_classes` entry of policies.yaml
    (`class_name` set), or a request's effective SLO (its class tightened by its headers; `class_name`
    "" when only headers set it)."""

    ttft_ms: float | None
    tpot_ms: float | None
    on_miss: MissAction = "proceed"
    max_queue_ms: float = DEFAULT_MAX_QUEUE_MS
    max_queued: int = 256
    compare: Compare = "probability"
    min_probability: float = DEFAULT_MIN_PROBABILITY
    class_name: str = ""

    @classmethod
    def from_config(cls, name: str, config: SloClassConfig) -> Slo:
        return cls(
            ttft_ms=config.ttft_ms,
            tpot_ms=config.tpot_ms,
            on_miss=config.on_miss,
            max_queue_ms=config.max_queue_ms if config.max_queue_ms is not None else DEFAULT_MAX_QUEUE_MS,
            max_queued=config.max_queued,
            compare=config.compare,
            min_probability=config.min_probability,
            class_name=name,
        )


def effective_slo(
    slo_class: Slo | None, ttft_header_ms: float | None = None, tpot_header_ms: float | None = None
) -> Slo | None:
    """The SLO a request runs under; None when neither its class nor its headers set one.

    Headers only tighten (min with the class). Headers without a class steer routing to endpoints
    that meet them and shed sheddable callers on a miss, but otherwise proceed best effort: an
    operator's class, not a client's header, decides whether to fall back, queue or reject.
    """
    if slo_class is None:
        if ttft_header_ms is None and tpot_header_ms is None:
            return None
        return Slo(ttft_ms=ttft_header_ms, tpot_ms=tpot_header_ms)
    return replace(
        slo_class,
        ttft_ms=_tightest(slo_class.ttft_ms, ttft_header_ms),
        tpot_ms=_tightest(slo_class.tpot_ms, tpot_header_ms),
    )


def _tightest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


@dataclass(frozen=True, slots=True)
class EndpointCheck:
    """How one endpoint's prediction stands against the SLO.

    Excess is the compared quantity over each target, ms (<= 0 fits; 0 for unset targets; the
    median for `compare: probability`); `probability` the predicted chance of meeting every target
    (1.0 when none is set, and with another `compare`, which never reads it); `meets` the verdict
    under the class's `compare`."""

    endpoint_id: str
    ttft_excess_ms: float
    tpot_excess_ms: float
    idle: bool
    probability: float = 1.0
    meets: bool = False


@dataclass(frozen=True, slots=True)
class Meet:
    """Route among `endpoint_ids`: the ones that meet the SLO, or the idle ones when none does."""

    endpoint_ids: frozenset[str]
    idle_only: bool = False  # none meets it; these are idle (see the module docstring)


@dataclass(frozen=True, slots=True)
class Miss:
    """No endpoint meets it. `closest` is the likeliest to meet it (`compare: probability`) or the
    one with the smallest excess (for the message and retry-after)."""

    action: Action
    closest: EndpointCheck

    def retry_after_s(self, floor_s: float = 1.0, cap_s: float = 60.0) -> int:
        """Whole seconds until the closest endpoint may meet it: its TTFT excess (work that must drain
        first), at least `floor_s`, at most `cap_s` (older openai SDKs ignore longer)."""
        return int(min(max(math.ceil(self.closest.ttft_excess_ms / 1000.0), floor_s), cap_s))


def check_endpoint(
    slo: Slo, prediction: Prediction, running_tpot_slo_ms: float | None = None, elapsed_ms: float = 0.0
) -> EndpointCheck:
    """One endpoint against the SLO (see the module docstring for what is compared)."""
    p90 = slo.compare == "p90"
    chance = slo.compare == "probability"
    ttft_excess = tpot_excess = 0.0
    probability = 1.0
    if slo.ttft_ms is not None:
        budget = slo.ttft_ms - elapsed_ms
        ttft_excess = (prediction.ttft_p90_ms if p90 else prediction.ttft_ms) - budget
        if chance:
            probability *= prediction.within(Target.TTFT, budget)
    bound = _tightest(slo.tpot_ms, running_tpot_slo_ms)
    if bound is not None:
        tpot_excess = (prediction.tpot_p90_ms if p90 else prediction.tpot_ms) - bound
        if chance:
            probability *= prediction.within(Target.TPOT, bound)
    meets = probability >= slo.min_probability if chance else ttft_excess <= 0.0 and tpot_excess <= 0.0
    return EndpointCheck(prediction.endpoint_id, ttft_excess, tpot_excess, _idle(prediction), probability, meets)


def _idle(prediction: Prediction) -> bool:
    """Nothing running, waiting or in flight there when it was predicted (read from its feature row)."""
    row = prediction.features
    return not (row[Feature.RUNNING] or row[Feature.WAITING] or row[Feature.INFLIGHT_REQUESTS])


def decide(
    slo: Slo,
    predictions: Iterable[Prediction],
    *,
    priority: int,
    running_tpot_slo_ms: Mapping[str, float] | None = None,
    elapsed_ms: float = 0.0,
) -> Meet | Miss:
    """Meet (the endpoints that meet `slo`) or Miss (what to do instead) over at least one prediction
    (with none there is nothing to decide: the gateway proceeds)."""
    floors = running_tpot_slo_ms or {}
    checks = [check_endpoint(slo, p, floors.get(p.endpoint_id), elapsed_ms) for p in predictions]
    if not checks:
        raise ValueError("decide() needs the prediction of at least one endpoint")
    meeting = frozenset(c.endpoint_id for c in checks if c.meets)
    if meeting:
        return Meet(meeting)
    idle = frozenset(c.endpoint_id for c in checks if c.idle)
    if idle:
        return Meet(idle, idle_only=True)
    if slo.compare == "probability":
        closest = max(checks, key=lambda c: c.probability)
    else:
        closest = min(checks, key=lambda c: max(c.ttft_excess_ms, 0.0) + max(c.tpot_excess_ms, 0.0))
    return Miss("shed" if priority < 0 else slo.on_miss, closest)

"""Scorers: each scores a pool's candidates in [0, 1] (higher is better); the pipeline weighs them
(`pipeline.py`) under the names `registry.py` gives them. Each is a frozen dataclass whose fields are
its `params`, whose `consumes` names the signals it reads, and whose docstring gives its formula."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backends.types import Endpoint
from policies.routing.types import Candidate, RouteContext
from predictor.service import LatencyPredictor
from predictor.types import Prediction, RequestShape


def work_tokens(endpoint: Endpoint, decode_weight: float, request_tokens: float = 0.0) -> float:
    """Pending work on `endpoint` in prefill-token equivalents, from the gateway's own in-flight
    accounting: exact and instant (updated at dispatch, first token and completion), unlike scraped
    engine metrics, so token-level load signals are built on it (`work-cost`, the `load-gate` filter).

    `prefill_tokens` (uncached prompt tokens not yet prefilled) count 1 each: a chunked-prefill engine
    must compute them before a newcomer's own prefill finishes. Decode context counts `decode_weight`
    each (it slows every step by reading KV, and it occupies KV). `request_tokens` per in-flight
    request covers requests whose decode load is not yet known (still prefilling).
    """
    inflight = endpoint.inflight
    return inflight.prefill_tokens + decode_weight * inflight.decode_tokens + request_tokens * inflight.requests


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheScorer:
    """Share of the prompt already in the endpoint's KV cache, each tier at its credit.

        score = credited_tokens / prompt_tokens      (0 for an empty prompt)

    credited_tokens = HBM hits + each lower tier's hits x its credit (`prefix.tiers`: the prefill
    time a hit saves minus the time to load it; every hit counts 1 without tiers).
    Range [0, 1]: 1 means the whole prompt (but the last token, which is always computed) is cached
    in HBM. Absolute, not relative to the best candidate: a 5 % hit must not look like a full one.
    Reads: `Candidate.credited` (prefix index and tier pricing), `RouteContext.prompt_tokens`.
    """

    consumes = ("prefix-index",)

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        if ctx.prompt_tokens <= 0:
            return [0.0] * len(candidates)
        return [min(c.credited / ctx.prompt_tokens, 1.0) for c in candidates]


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueDepthScorer:
    """Engine-reported waiting requests, relative to the shortest queue among the candidates.

        score = (q_min + s) / (q + s)       q = EndpointStats.waiting, s = smoothing_requests

    Range (0, 1]: the shortest queue scores 1, twice the work scores about 1/2; all equal -> 1.
    A ratio rather than llm-d's min-max: queues of 0 and 1 are not "best" and "worst". Saturated
    (stale) candidates score 0. Reads: `EndpointStats.waiting`. It sees load from every client of the
    engine (other gateway replicas included), which the gateway's own counters cannot.
    """

    smoothing_requests: float = 1.0
    consumes = ("stats.waiting",)

    def __post_init__(self) -> None:
        if self.smoothing_requests <= 0:
            raise ValueError("smoothing_requests must be > 0")

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        s = self.smoothing_requests
        fresh = [c.endpoint.stats.waiting for c in candidates if not c.saturated]
        if not fresh:
            return [0.0] * len(candidates)
        best = min(fresh) + s
        return [0.0 if c.saturated else best / (c.endpoint.stats.waiting + s) for c in candidates]


@dataclass(frozen=True, slots=True, kw_only=True)
class KvUsageScorer:
    """Free KV-cache room: an endpoint near full preempts (recomputes) running requests.

        score = 1 - kv_usage_ratio

    Range [0, 1] (clamped); saturated (stale) candidates score 0. Reads: `EndpointStats.kv_usage_ratio`
    (vLLM counts evictable cached blocks as free, so a warm cache does not look full).
    """

    consumes = ("stats.kv_usage_ratio",)

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        return [0.0 if c.saturated else min(max(1.0 - c.endpoint.stats.kv_usage_ratio, 0.0), 1.0) for c in candidates]


@dataclass(frozen=True, slots=True, kw_only=True)
class InflightTokensScorer:
    """Tokens the gateway has in flight on the endpoint, relative to the least loaded candidate.

        x = inflight.prefill_tokens + inflight.decode_tokens
        score = (x_min + r) / (x + r)        r = ref_tokens

    Range (0, 1]: the least loaded scores 1; `ref_tokens` keeps small absolute differences (an
    idle fleet) from looking large. Saturated (stale) candidates score 0. Reads: `InFlight` (uncached
    prefill pending + decode context), the gateway's exact, instant accounting.
    """

    ref_tokens: float = 2048.0
    consumes = ("inflight.prefill_tokens", "inflight.decode_tokens")

    def __post_init__(self) -> None:
        if self.ref_tokens <= 0:
            raise ValueError("ref_tokens must be > 0")

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        loads = [c.endpoint.inflight.prefill_tokens + c.endpoint.inflight.decode_tokens for c in candidates]
        fresh = [x for x, c in zip(loads, candidates, strict=True) if not c.saturated]
        if not fresh:
            return [0.0] * len(candidates)
        best = min(fresh) + self.ref_tokens
        return [0.0 if c.saturated else best / (x + self.ref_tokens) for x, c in zip(loads, candidates, strict=True)]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionAffinityScorer:
    """Keeps a session (header or the OpenAI `user` field) on the endpoint that served it last.

        score = 1 if endpoint is the session's pinned endpoint else 0

    Range {0, 1}. The pin is made at dispatch, so a session follows its endpoint when load or a
    failure moved it. Reads: `RouteContext.session_endpoint_id` (the router's session table).
    """

    consumes = ("session",)

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        pinned = ctx.session_endpoint_id
        return [1.0 if pinned is not None and c.id == pinned else 0.0 for c in candidates]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkCostScorer:
    """How much work stands between this request and its first token on the endpoint.

        cost  = inflight.prefill_tokens                 (uncached prefill queued ahead of it)
              + (prompt_tokens - credited_tokens)        (its own prefill, and loading its lower-tier hits)
              + decode_weight  * inflight.decode_tokens  (decode context sharing every step)
              + request_tokens * inflight.requests       (requests whose decode is not counted yet)
        score = (cost_min + base_tokens) / (cost + base_tokens)

    Range (0, 1]: the cheapest candidate scores 1, one with twice the work about 1/2. This is the
    trade-off the router exists for: a prefix hit saves `cached_tokens` of work, a busy endpoint
    costs its backlog, and the cheaper sum wins. `base_tokens` keeps an idle fleet from turning
    small differences into large ratios. Saturated (stale) candidates score 0.
    credited_tokens (`prefix.tiers`, in prefill-token equivalents): HBM hits count 1 each; a hit in
    host DRAM, on disk or in a remote store counts the share of its prefill time that loading it saves,
    so its load time stays in the cost. Without lower tiers it is `cached_tokens`.
    Reads: `InFlight` (gateway accounting), `Candidate.credited`, `RouteContext.prompt_tokens`.
    """

    decode_weight: float = 0.1
    request_tokens: float = 128.0
    base_tokens: float = 512.0
    consumes = ("inflight", "prefix-index")

    def __post_init__(self) -> None:
        if self.base_tokens <= 0:
            raise ValueError("base_tokens must be > 0")
        if self.decode_weight < 0 or self.request_tokens < 0:
            raise ValueError("decode_weight and request_tokens must be >= 0")

    def costs(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        return [
            work_tokens(c.endpoint, self.decode_weight, self.request_tokens) + ctx.uncached_work(c) for c in candidates
        ]

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        costs = self.costs(ctx, candidates)
        fresh = [x for x, c in zip(costs, candidates, strict=True) if not c.saturated]
        if not fresh:
            return [0.0] * len(candidates)
        best = min(fresh) + self.base_tokens
        return [0.0 if c.saturated else best / (x + self.base_tokens) for x, c in zip(costs, candidates, strict=True)]


def predict_candidates(
    predictor: LatencyPredictor, pool: str, model: str, ctx: RouteContext, candidates: Sequence[Candidate]
) -> dict[str, Prediction]:
    """Every candidate's prediction (one batched `predict`), by endpoint id: the one call that makes a
    request's latency predictions while it is routed.

    When the router has a predictor and the request needs predictions (its pool's pipeline has the
    `latency` scorer, or the request carries an SLO for the gateway's SLO gate), `ScoringRouter.route`
    predicts every candidate in one batched call before the pipeline runs: the latency scorer reads
    them in `RouteContext.predictions`, the decision carries them (`RouteDecision.predictions`) to the
    SLO gate, and the gateway reuses the serving endpoint's prediction as the training sample's
    features instead of predicting twice.
    """
    facts = ctx.facts
    shape = RequestShape(ctx.prompt_tokens, facts.max_tokens, facts.principal.tenant, model)
    endpoints = [c.endpoint for c in candidates]
    cached = [c.cached_tokens for c in candidates]
    # of them, those below HBM (the tiers the credit sees: `cached_tokens` counts them, `tiers.gpu` does not)
    lower = [max(c.cached_tokens - c.tiers.gpu, 0) if c.tiers is not None else 0 for c in candidates]
    made = predictor.predict(pool, shape, endpoints, cached, ctx.now_s, lower)
    return {p.endpoint_id: p for p in made}


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyScorer:
    """Predicted latency, SLO first: every endpoint predicted to meet the request's SLO outranks every
    one predicted to miss it, and the fastest predicted wins within each tier.

    Per candidate, targets T_ttft = facts.slo_ttft_ms and T_tpot = min(facts.slo_tpot_ms, the
    tightest TPOT SLO running on the endpoint), compared with the predicted p90 q. With t, u the
    predicted mean TTFT and TPOT and s = `smoothing_ms`, the relative latency

        rel = (w_ttft (t_min + s) / (t + s) + w_tpot (u_min + s) / (u + s)) / (w_ttft + w_tpot)

    (1 for the fastest fresh candidate) scores

        no target set (no SLO, nothing protected)   rel                                      in (0, 1]
        meets every target (q_k <= T_k)            0.5 + 0.5 rel                            in (0.5, 1]
        misses one                                 0.5 / (1 + sum_k w_k max(0, q_k / T_k - 1) / sum_k w_k)

    Why relative latency inside the tier and not headroom (T - q) / T, llm-d's "most headroom": at
    a loose SLO nearly every endpoint meets it, and headroom then barely tells a 100 ms endpoint from
    a 500 ms one (slack 0.9 vs 0.5 of a 1 s objective), while their relative latency is 1 vs 0.2. On
    the simulated fleet at 90 % load with the SLO gate (bench/results/predictor-tight.md,
    predictor-tight-ablation.md, predictor-scorer-tight.md; one run each): attainment 90.8 % with
    the headroom ranking, 92.1 % with the gate and no scorer, 94.6 % with this one (82.9 % with
    neither). Weights default to llm-d's TTFT 0.8 / TPOT 0.2. Range [0, 1]: saturated (stale) candidates score 0;
    with no predictions (predictor disabled) every candidate scores 1, leaving the decision to the
    other scorers.

    Reads: `ctx.predictions` (made by the router in one batched call for all candidates, see
    `predict_candidates` above), `facts.slo_ttft_ms`/`slo_tpot_ms`, and `ctx.running_tpot_slo_ms`
    (kept by the gateway's SLO hook).

    Not in the default pipeline yet: alone (no SLO class) it lifted attainment at 90 % load from
    82.9 % to 88.0 % at the tight SLO and from 92.2 % to 96.8 % at the loose one (78.0 % to 87.2 %
    measured later in the window, where a queue builds; one run each), but
    the routing benchmark (bench/results/replay.md, prefix-heavy traffic, where work-cost and prefix
    scoring decide) has not been run with it. Add it with weight 2-3 where predicted latency, rather
    than least work, should pick the endpoint.
    """

    ttft_weight: float = 0.8
    tpot_weight: float = 0.2
    smoothing_ms: float = 5.0
    consumes = ("predictions", "slo", "running-tpot-slo")

    def __post_init__(self) -> None:
        if self.ttft_weight < 0 or self.tpot_weight < 0 or self.ttft_weight + self.tpot_weight <= 0:
            raise ValueError("ttft_weight and tpot_weight must be >= 0, not both 0")
        if self.smoothing_ms <= 0:
            raise ValueError("smoothing_ms must be > 0")

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        facts = ctx.facts
        predictions = ctx.predictions
        if not predictions:
            return [1.0] * len(candidates)
        floors = ctx.running_tpot_slo_ms
        found = [None if c.saturated else predictions.get(c.id) for c in candidates]
        relative = self._relative(found)
        targeted = facts.slo_ttft_ms is not None or facts.slo_tpot_ms is not None
        if not targeted and not any(c.id in floors for c in candidates):
            return relative
        return [
            0.0 if p is None else self._tiered(p, rel, facts.slo_ttft_ms, _min(facts.slo_tpot_ms, floors.get(c.id)))
            for c, p, rel in zip(candidates, found, relative, strict=True)
        ]

    def _tiered(self, p: Prediction, relative: float, ttft_ms: float | None, tpot_ms: float | None) -> float:
        weight = excess = 0.0
        if ttft_ms is not None:
            weight += self.ttft_weight
            excess += self.ttft_weight * max(0.0, p.ttft_p90_ms / ttft_ms - 1.0)
        if tpot_ms is not None:
            weight += self.tpot_weight
            excess += self.tpot_weight * max(0.0, p.tpot_p90_ms / tpot_ms - 1.0)
        if weight <= 0:  # the only target set has weight 0: latency alone
            return relative
        if excess > 0:
            return 0.5 / (1.0 + excess / weight)
        return 0.5 + 0.5 * relative

    def _relative(self, found: Sequence[Prediction | None]) -> list[float]:
        fresh = [p for p in found if p is not None]
        if not fresh:
            return [0.0] * len(found)
        s = self.smoothing_ms
        best_ttft = min(p.ttft_ms for p in fresh) + s
        best_tpot = min(p.tpot_ms for p in fresh) + s
        total = self.ttft_weight + self.tpot_weight
        return [
            0.0
            if p is None
            else (self.ttft_weight * best_ttft / (p.ttft_ms + s) + self.tpot_weight * best_tpot / (p.tpot_ms + s))
            / total
            for p in found
        ]


def _min(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)

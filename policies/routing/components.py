"""The pipeline's components by the kebab-case names gateway.yaml gives them: the filters, scorers and
pickers of a pool's pipeline, and the baseline routers a pool may use instead of it (`router:`).

Registry. One read-only mapping per kind (`FILTERS`, `SCORERS`, `PICKERS`, `BASELINE_ROUTERS`), built
once; adding a component is one class (here, or in `lora.py` / `tool_affinity.py`) plus one line in
its mapping. Factories take the component's `params` as keyword arguments and raise on unknown or
invalid ones (`build(kind, name, params)`).

Filters: each removes the candidates that must not serve a request, before any scorer runs.

Scorers: each scores a pool's candidates in [0, 1] (higher is better); the pipeline weighs them
(`pipeline.py`). Each is a frozen dataclass whose fields are its `params`, whose `consumes` names the
signals it reads, and whose docstring gives its formula.

Pickers: each chooses one candidate from the weighed totals (normalised to [0, 1]).

Baselines: the routers that every cache-aware router is measured against. `round-robin` keeps one
rotating cursor per pool and ignores load and prefixes entirely, which is what `vllm-router --policy
round_robin` and most L4 load balancers do. `least-inflight`, the simplest load-aware router, takes
the ready endpoint with the fewest in-flight requests (ties rotate): the "least-load" baseline.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from backends.fleet import Pool
from backends.types import Endpoint
from policies.routing.lora import LoraAffinityScorer, LoraSlotsFilter
from policies.routing.tool_affinity import ToolAffinityScorer
from policies.routing.types import (
    REASON_LOAD,
    REASON_ONLY,
    Candidate,
    Filter,
    Picker,
    RouteContext,
    RouteDecision,
    Router,
    RouteRequest,
    Scorer,
)
from predictor.features import Prediction, RequestShape
from predictor.service import LatencyPredictor


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

    credited_tokens = HBM hits + each lower tier's hits x its credit (`kv_tiers.py`: the prefill
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
    credited_tokens (`kv_tiers.py`, in prefill-token equivalents): HBM hits count 1 each; a hit in
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


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextLengthFilter:
    """Drops endpoints whose context window cannot hold the prompt plus the requested output.

        keep iff max_model_len is unknown or prompt_tokens + max_tokens <= max_model_len

    A pool of mixed windows (e.g. 32k and 128k replicas) sends long prompts only where they fit,
    instead of to an engine that answers 400. Reads: `Endpoint.max_model_len`, `RequestFacts.max_tokens`.
    """

    consumes = ("endpoint.max_model_len",)

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        needed = ctx.prompt_tokens + (ctx.facts.max_tokens or 0)
        return [c for c in candidates if c.endpoint.max_model_len is None or needed <= c.endpoint.max_model_len]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadGateFilter:
    """Drops candidates far busier than the least busy one, whatever their prefix or session offers.

    With `load` = in-flight requests (`metric: requests`) or pending work tokens (`metric: tokens`,
    uncached prefill + `decode_weight` x decode context), a candidate is over the gate when

        load - load_min > abs_threshold   and   load > rel_threshold * load_min

    (SGLang's balance test, per candidate and in the gateway's exact counters). This is the hot-spot
    guard: requests sharing a prefix go to its holder until the holder crosses the gate, then spread;
    identical concurrent prompts cannot all land on one replica. Saturated candidates are judged on
    the same counters. Reads: `InFlight`.
    """

    metric: Literal["requests", "tokens"] = "requests"
    abs_threshold: float = 8.0
    rel_threshold: float = 1.5
    decode_weight: float = 0.1
    consumes = ("inflight",)

    def __post_init__(self) -> None:
        if self.abs_threshold < 0 or self.rel_threshold < 1.0:
            raise ValueError("abs_threshold must be >= 0 and rel_threshold >= 1")

    def load(self, endpoint: Endpoint) -> float:
        if self.metric == "requests":
            return float(endpoint.inflight.requests)
        return work_tokens(endpoint, self.decode_weight)

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        if len(candidates) <= 1:
            return list(candidates)
        loads = [self.load(c.endpoint) for c in candidates]
        low = min(loads)
        return [
            c
            for c, x in zip(candidates, loads, strict=True)
            if not (x - low > self.abs_threshold and x > self.rel_threshold * low)
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixAffinityFilter:
    """Sticky until saturated: keep only the cache-warm candidates, unless waiting behind their
    prefill backlog would cost more than `max_ttft_penalty_s` over the best cold candidate.

        warm     = {c : cached_tokens(c) >= threshold x prompt_tokens}
        keep all  if warm is empty, or every candidate is warm, or
                  (min_warm prefill_tokens - min_cold prefill_tokens) / peak_prefill_tokens_per_s
                      > max_ttft_penalty_s
        keep warm otherwise

    `prefill_tokens` is the gateway's count of uncached prompt tokens in flight on the endpoint
    (released at the first token), so the backlog gap over `peak_prefill_tokens_per_s` is the extra
    wait a warm endpoint imposes; the release fires at a gap of tau = peak x penalty tokens.

    Why it exists: llm-d's default for prefill-bound traffic (its `prefix-cache-affinity-filter`,
    with defaults 0.8, 18 s, 15,928 tok/s; followed by `token-load-scorer` and `max-score-picker`,
    which here is `work-cost` with `decode_weight: 0, request_tokens: 0` and `max-score`), kept so the
    replay benchmark can compare tokenway's default against it (bench/replay/NOTES.md). Unlike
    `load-gate`, the warm set is decided by prefix share alone and only a gap of seconds of prefill
    releases it. Reads: `Candidate.cached_tokens`, `InFlight.prefill_tokens`.
    """

    threshold: float = 0.8
    max_ttft_penalty_s: float = 18.0
    peak_prefill_tokens_per_s: float = 15_928.0
    consumes = ("prefix-index", "inflight.prefill_tokens")

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        if self.max_ttft_penalty_s < 0 or self.peak_prefill_tokens_per_s <= 0:
            raise ValueError("max_ttft_penalty_s must be >= 0 and peak_prefill_tokens_per_s > 0")

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        if len(candidates) <= 1 or ctx.prompt_tokens <= 0:
            return list(candidates)
        need = self.threshold * ctx.prompt_tokens
        warm = [c for c in candidates if c.cached_tokens >= need]
        cold = [c for c in candidates if c.cached_tokens < need]
        if not warm or not cold:
            return list(candidates)
        if self.max_ttft_penalty_s > 0:
            gap = min(c.endpoint.inflight.prefill_tokens for c in warm) - min(
                c.endpoint.inflight.prefill_tokens for c in cold
            )
            if gap / self.peak_prefill_tokens_per_s > self.max_ttft_penalty_s:
                return list(candidates)
        return warm


_TIE = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class MaxScorePicker:
    """The highest total; ties (within 1e-9) broken uniformly at random.

    Deterministic affinity, so it hot-spots under identical traffic unless a load gate or load
    scorer pushes back; prefer `near-best-random` for production.
    """

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int:
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if t >= best - _TIE]
        return tied[0] if len(tied) == 1 else rng.choice(tied)


@dataclass(frozen=True, slots=True, kw_only=True)
class NearBestRandomPicker:
    """Uniformly at random among the candidates whose total is within `tolerance` of the best.

        near = {i : total_i >= max(total) - tolerance}      (totals are normalised to [0, 1])

    Differences smaller than the scorers' noise (a scrape 250 ms old, an estimate of cached tokens)
    should not decide; spreading among equals keeps identical prompts arriving together from piling
    onto one replica, while a clearly better candidate (a long prefix hit) still wins alone.
    """

    tolerance: float = 0.03

    def __post_init__(self) -> None:
        if not 0.0 <= self.tolerance <= 1.0:
            raise ValueError("tolerance must be in [0, 1]")

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int:
        floor = max(totals) - self.tolerance - 1e-9
        near = [i for i, t in enumerate(totals) if t >= floor]
        return near[0] if len(near) == 1 else rng.choice(near)


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightedRandomPicker:
    """Chance proportional to the total score (A-Res: the largest key U^(1/total) wins).

    Every candidate with a positive total can be chosen; all-zero totals choose uniformly. Spreads
    more than `near-best-random`, at the price of sometimes picking a clearly worse endpoint.
    """

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int:
        if max(totals) <= 0.0:
            return rng.randrange(len(totals))
        best_i, best_key = 0, -1.0
        for i, t in enumerate(totals):
            if t <= 0.0:
                continue
            key = rng.random() ** (1.0 / t)
            if key > best_key:
                best_i, best_key = i, key
        return best_i


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomPicker:
    """Uniformly at random, ignoring the scores (a baseline, or behind filters that did the work)."""

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int:
        return rng.randrange(len(candidates))


class RoundRobinRouter:
    def __init__(self) -> None:
        self._turn: dict[str, int] = {}

    def route(
        self, request: RouteRequest, pool: Pool, now_s: float, exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        candidates = pool.servable(exclude)
        if not candidates:
            return None
        turn = self._turn.get(pool.name, 0)
        self._turn[pool.name] = turn + 1
        chosen = candidates[turn % len(candidates)]
        return RouteDecision(
            endpoint=chosen, reason=REASON_LOAD if len(candidates) > 1 else REASON_ONLY, decided_at_s=now_s
        )

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        return None


class LeastInflightRouter:
    def __init__(self) -> None:
        self._turn = 0

    def route(
        self, request: RouteRequest, pool: Pool, now_s: float, exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        candidates = pool.servable(exclude)
        if not candidates:
            return None
        self._turn += 1
        n = len(candidates)
        best = min(range(n), key=lambda i: (candidates[i].inflight.requests, (i - self._turn) % n))
        return RouteDecision(
            endpoint=candidates[best], reason=REASON_LOAD if n > 1 else REASON_ONLY, decided_at_s=now_s
        )

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        return None


FILTERS: Mapping[str, Callable[..., Filter]] = MappingProxyType(
    {
        "load-gate": LoadGateFilter,
        "context-length": ContextLengthFilter,
        "lora-slots": LoraSlotsFilter,
        "prefix-affinity": PrefixAffinityFilter,
    }
)

SCORERS: Mapping[str, Callable[..., Scorer]] = MappingProxyType(
    {
        "prefix-cache": PrefixCacheScorer,
        "queue-depth": QueueDepthScorer,
        "kv-usage": KvUsageScorer,
        "inflight-tokens": InflightTokensScorer,
        "session-affinity": SessionAffinityScorer,
        "work-cost": WorkCostScorer,
        "latency": LatencyScorer,
        "lora-affinity": LoraAffinityScorer,
        "tool-affinity": ToolAffinityScorer,
    }
)

PICKERS: Mapping[str, Callable[..., Picker]] = MappingProxyType(
    {
        "max-score": MaxScorePicker,
        "near-best-random": NearBestRandomPicker,
        "weighted-random": WeightedRandomPicker,
        "random": RandomPicker,
    }
)

# Routers that replace the whole pipeline for a pool (`router:` in a pipeline config); "scoring" is
# the pipeline itself and is built by `policies.routing.pipeline`.
BASELINE_ROUTERS: Mapping[str, Callable[[], Router]] = MappingProxyType(
    {
        "least-inflight": LeastInflightRouter,
        "round-robin": RoundRobinRouter,
    }
)

REGISTRIES: Mapping[str, Mapping[str, Callable[..., Any]]] = MappingProxyType(
    {"filter": FILTERS, "scorer": SCORERS, "picker": PICKERS}
)


def build(kind: str, name: str, params: Mapping[str, Any]) -> Any:
    """Instantiate a registered component; ValueError names the kind, the name and what is wrong."""
    registry = REGISTRIES[kind]
    factory = registry.get(name)
    if factory is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")
    try:
        return factory(**params)
    except TypeError as exc:
        raise ValueError(f"{kind} {name!r}: bad params {dict(params)!r}: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{kind} {name!r}: {exc}") from exc

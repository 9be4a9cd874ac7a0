"""The scoring router: per pool, filters -> weighted scorers -> picker, over a shared prefix index,
with the session table that pins conversations.

    route(request, pool, now_s, exclude):
      candidates  = ready endpoints of the pool not in `exclude` (decode/mixed ones in a PD pool),
                    each with the prefix index's cached tokens per KV tier, priced by the pool's
                    tier credit (`kv_tiers.py`); stale stats -> saturated
      saturated   are dropped unless every candidate is (then: reason `fallback`)
      predictions with a predictor, when the pipeline has the `latency` scorer or the request an
                  SLO: every candidate in one call (`components.predict_candidates`), read by the
                  scorer and carried by the decision
      filters     run in order; one that would leave nothing is skipped (reason `fallback`)
      total_i     = sum_k w_k * clamp(score_k,i, 0, 1) / sum_k w_k          (in [0, 1])
      picker      chooses from the totals
      PD pools    then decide prefill placement (`policies.routing.pd`) and, with topology labels,
                  the pair by prefill + KV transfer time over its link (`policies.routing.pd`:
                  `choose_pair`)

Decisions are synchronous and read the fleet as it is; `on_dispatch` records the prompt's blocks on
the chosen endpoint(s) and pins the session. Prompt hashes are computed once per request and reused
across candidates, retries and `on_dispatch`.

Session table: session key -> the endpoint that served the session last (bounded LRU). Keys come
from the client (`x-session-id`, the body's `user`), so the table is bounded in entries
(`max_sessions`) and in bytes per entry: a key longer than MAX_SESSION_KEY_CHARS is kept as a 128-bit
hash of its bytes (the same session still maps to the same pin; `bounded_key`, which the gateway also
uses for the other client-named ids it keeps).
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from backends.fleet import Pool, budget_bytes
from backends.kv_events import KvEventBatch
from backends.perf.presets import DEFAULT_PRESET, resolve_preset
from backends.types import Endpoint, EndpointState, Role
from policies.routing import components
from policies.routing.components import predict_candidates
from policies.routing.config import KvTiersConfig, PDConfig, PipelineConfig, RoutingConfig, ToolAffinityConfig
from policies.routing.kv_tiers import PHYSICS, TIER_NAMES, KvSupply, SupplyMeter, TierLink, TierPricing
from policies.routing.lora import AdapterResidency
from policies.routing.pd import Pair, PairCosts, PDOutcome, choose_pair, decide_pd, price
from policies.routing.prefix_blocks import EngineHasher, HashedPrompt, prompt_tokens_of
from policies.routing.prefix_index import IndexReport, PrefixIndex
from policies.routing.tool_affinity import GapLearner, ToolReturns, ToolShare
from policies.routing.types import (
    PD_DISAGGREGATED,
    REASON_FALLBACK,
    REASON_LOAD,
    REASON_ONLY,
    REASON_PREFIX_HIT,
    REASON_SESSION,
    REASON_TOOL_RETURN,
    Candidate,
    Filter,
    Picker,
    RouteContext,
    RouteDecision,
    Router,
    RouteRequest,
    Scorer,
)
from policies.types import RequestFacts
from predictor.service import LatencyPredictor

log = logging.getLogger(__name__)

PREFIX_HIT_SHARE_OF_BEST = 0.9  # chosen holds >= 90 % of the best cached prefix -> "prefix-hit"


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    name: str
    weight: float
    scorer: Scorer


@dataclass(slots=True)
class Choice:
    """The outcome of one pipeline run: the chosen candidate and what led to it."""

    candidates: list[Candidate]  # the scored ones (after saturation and filters)
    index: int
    totals: list[float]
    scores: dict[str, list[float]]  # scorer name -> clamped score per candidate
    fallback: bool

    @property
    def chosen(self) -> Candidate:
        return self.candidates[self.index]

    def debug_scores(self, prefix: str = "") -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for i, c in enumerate(self.candidates):
            row = {name: values[i] for name, values in self.scores.items()}
            row["total"] = self.totals[i]
            row["cached"] = float(c.cached_tokens)
            if c.credited_tokens is not None:
                row["credited"] = c.credited_tokens
            out[prefix + c.id] = row
        return out


class Pipeline:
    """Filters, weighted scorers and a picker, built from one `PipelineConfig`."""

    def __init__(self, filters: Sequence[Filter], scorers: Sequence[WeightedScorer], picker: Picker) -> None:
        self.filters = list(filters)
        self.scorers = [s for s in scorers if s.weight > 0]
        self.picker = picker
        weight_sum = sum(s.weight for s in self.scorers) or 1.0
        self.normalized_weights = [s.weight / weight_sum for s in self.scorers]
        self.uses_session = any(s.name == "session-affinity" for s in self.scorers)
        self.uses_latency = any(s.name == "latency" for s in self.scorers)
        self.uses_tool_affinity = any(s.name == "tool-affinity" for s in self.scorers)

    @classmethod
    def from_config(cls, config: PipelineConfig) -> Pipeline:
        return cls(
            filters=[components.build("filter", f.type, f.params) for f in config.filters],
            scorers=[
                WeightedScorer(s.type, s.weight, components.build("scorer", s.type, s.params)) for s in config.scorers
            ],
            picker=components.build("picker", config.picker.type, config.picker.params),
        )

    def choose(self, ctx: RouteContext, candidates: Sequence[Candidate], rng: random.Random) -> Choice:
        """Run the pipeline over non-empty `candidates`.

        A lone candidate is the answer whatever the filters and scorers say (a filter that would
        drop it is skipped), so they run only when a debug header wants its scores."""
        if len(candidates) == 1 and not ctx.facts.debug:
            return Choice(list(candidates), 0, [1.0], {}, candidates[0].saturated)
        pool = [c for c in candidates if not c.saturated]
        fallback = not pool
        if fallback:
            pool = list(candidates)
        for f in self.filters:
            kept = f.filter(ctx, pool)
            if kept:
                pool = kept
            else:
                fallback = True
        totals = [0.0] * len(pool)
        scores: dict[str, list[float]] = {}
        for ws, w in zip(self.scorers, self.normalized_weights, strict=True):
            # clamp to [0, 1]; NaN fails both comparisons and becomes 0
            clamped = [s if 0.0 <= s <= 1.0 else (1.0 if s > 1.0 else 0.0) for s in ws.scorer.score(ctx, pool)]
            scores[ws.name] = clamped
            totals = [t + w * s for t, s in zip(totals, clamped, strict=True)]
        index = 0 if len(pool) == 1 else self.picker.pick(ctx, pool, totals, rng)
        return Choice(pool, index, totals, scores, fallback)


def decision_reason(ctx: RouteContext, choice: Choice, candidates: Sequence[Candidate], uses_session: bool) -> str:
    """The metrics label of a decision (see `policies.routing.types`)."""
    if len(candidates) == 1:
        return REASON_ONLY
    if choice.fallback:
        return REASON_FALLBACK
    chosen = choice.chosen
    if uses_session and ctx.session_endpoint_id == chosen.id:
        return REASON_SESSION
    if ctx.tool_return is not None and ctx.tool_return.endpoint_id == chosen.id:
        return REASON_TOOL_RETURN
    best_cached = max(c.cached_tokens for c in candidates)
    if chosen.cached_tokens > 0 and chosen.cached_tokens >= PREFIX_HIT_SHARE_OF_BEST * best_cached:
        return REASON_PREFIX_HIT
    return REASON_LOAD


def is_disaggregated(pool: Pool) -> bool:
    """A pool is disaggregated when any endpoint (ready or not) has the prefill or decode role."""
    return pool.disaggregated or any(e.role is not Role.BOTH for e in pool.endpoints)


@dataclass(slots=True)
class PDCounters:
    served: int = 0
    disaggregated: int = 0
    warned: bool = False


@dataclass(frozen=True, slots=True)
class RoutingReport:
    index: IndexReport
    sessions: int
    pd: dict[str, PDCounters]
    # prompt tokens dispatched, and of them the tokens expected from each KV tier (not recomputed)
    prompt_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)


def tier_pricing(pool: Pool, tiers: KvTiersConfig, credit: str | None = None) -> TierPricing:
    """A pool's tier credit: its preset (`model@hw`, the latency prior's default when it names none)
    gives the KV bytes per token and the prefill compute a hit saves; `tiers` the links, the pool's
    shared store (`kv_store`) the `remote` one when it has a store. `credit` overrides `tiers.credit`
    (the supply metrics price load times whatever the routing credit)."""
    mode = tiers.credit if credit is None else credit
    links = None
    preset = None
    if mode == PHYSICS:
        preset = resolve_preset(pool.config.preset or DEFAULT_PRESET, pool.config.tensor_parallel)
        store = pool.config.kv_store
        remote = tiers.remote if store is None else store
        links = (
            TierLink(tiers.cpu.bandwidth_gbps * 1e9, tiers.cpu.latency_ms / 1e3),
            TierLink(tiers.disk.bandwidth_gbps * 1e9, tiers.disk.latency_ms / 1e3),
            TierLink(remote.bandwidth_gbps * 1e9, remote.latency_ms / 1e3),
        )
    return TierPricing(mode, preset=preset, links=links, constant=tiers.constant_credits)


def supply_meter(pool: Pool, pricing: TierPricing, tiers: KvTiersConfig) -> SupplyMeter:
    """A pool's supply meter (`policies.routing.kv_tiers`): its preset, its credit, its tier links (the
    pool's config resolves its preset, the default one included, when it is loaded)."""
    physics = pricing if pricing.mode == PHYSICS else tier_pricing(pool, tiers, PHYSICS)
    assert physics.preset is not None
    return SupplyMeter(physics.preset, pricing, physics, pool.config.usd_per_gpu_hour)


@dataclass(slots=True)
class _PoolRouting:
    pipeline: Pipeline | None
    baseline: Router | None
    pd: PDConfig
    prefill: Pipeline | None


@dataclass(slots=True)
class ScoringRouter:
    """The gateway's router (implements `Router`) for every pool, built by `build_router`."""

    config: RoutingConfig
    index: PrefixIndex
    sessions: SessionTable
    rng: random.Random
    pd_counters: dict[str, PDCounters] = field(default_factory=dict)
    predictor: LatencyPredictor | None = None  # makes the latency scorer's and the SLO gate's predictions
    # told of every dispatch after it is recorded (gateway replicas share them); must not block
    dispatch_listener: Callable[[HashedPrompt, RouteDecision, str | None], None] | None = None
    _pools: dict[str, _PoolRouting] = field(default_factory=dict, init=False)
    residency: AdapterResidency = field(default_factory=AdapterResidency, init=False)  # LoRA (routing/lora.py)
    # programs expected back after a tool call (routing/tool_affinity.py): fed by the gateway
    # (`note_tool_call`), read by the `tool-affinity` scorer, gaps learnt at each return's dispatch
    tool_returns: ToolReturns = field(default_factory=ToolReturns)
    # told of this replica's tool-call notes and returns (gateway replicas share them: the replica bus)
    tool_share: ToolShare | None = None
    _pricing: dict[str, TierPricing] = field(default_factory=dict, init=False)
    _pair_costs: dict[str, PairCosts] = field(default_factory=dict, init=False)
    _meters: dict[str, SupplyMeter] = field(default_factory=dict, init=False)  # supply metrics, per pool
    _prompt_tokens: int = field(default=0, init=False)
    _tier_tokens: list[int] = field(default_factory=lambda: [0, 0, 0, 0], init=False)

    # -- Router ---------------------------------------------------------------------------------

    def route(
        self, request: RouteRequest, pool: Pool, now_s: float, exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        routing = self._routing(pool.name)
        if routing.baseline is not None:
            return routing.baseline.route(request, pool, now_s, exclude)
        assert routing.pipeline is not None
        ready = [e for e in pool.endpoints if e.state is EndpointState.READY and e.id not in exclude]
        pd = is_disaggregated(pool)
        serving = [e for e in ready if e.role is not Role.PREFILL] if pd else ready
        if not serving:
            return None
        facts = request.facts
        ctx = RouteContext(
            facts=facts,
            now_s=now_s,
            prompt_tokens=prompt_tokens_of(facts),
            session_endpoint_id=self.sessions.get(session_key(facts, pool.name, self.config.session.use_user_field)),
            running_tpot_slo_ms=request.running_tpot_slo_ms,
            adapter=request.adapter,
            residency=self.residency,
            # read by the LoRA scorer only, for a request that names an adapter
            lora_budget_bytes=budget_bytes(pool.config.lora_memory_budget_mb) if request.adapter is not None else None,
        )
        pricing = self._pricing.get(pool.name)
        if pricing is None:
            tiers_cfg = self.config.kv_tiers_for(pool.name)
            pricing = self._pricing[pool.name] = tier_pricing(pool, tiers_cfg)
            self._meters[pool.name] = supply_meter(pool, pricing, tiers_cfg)
            if pool.config.kv_store is not None:
                self.index.add_store(pool.name, pool.config.kv_store.capacity_tokens)
        if routing.pipeline.uses_tool_affinity:
            tenant = facts.principal.tenant
            ctx.tool_return = self.tool_returns.pending(tenant, facts.subjects.program, pool.name, now_s)
            ctx.reserved_tokens = self.tool_returns.reserved(pool.name, now_s)
        candidates = self._candidates(request, serving, now_s, pricing)
        if self.predictor is not None and (routing.pipeline.uses_latency or facts.slo is not None):
            ctx.predictions = predict_candidates(self.predictor, pool.name, pool.config.model, ctx, candidates)
        choice = routing.pipeline.choose(ctx, candidates, self.rng)
        chosen = choice.chosen
        decision = RouteDecision(
            endpoint=chosen.endpoint,
            reason=decision_reason(ctx, choice, candidates, routing.pipeline.uses_session),
            cached_tokens_estimate=chosen.cached_tokens,
            cached_tiers=chosen.tiers,
            decided_at_s=now_s,
            predictions=ctx.predictions,
        )
        debug = facts.debug
        if debug:
            decision.scores = choice.debug_scores()
        if pd:
            prefill_pipeline = routing.prefill
            assert prefill_pipeline is not None
            prefill_eps = [e for e in ready if e.role is not Role.DECODE and e.id != chosen.id]
            prefill_choice: list[Choice] = []

            def choose_prefill(options: Sequence[Candidate]) -> Candidate:
                picked = prefill_pipeline.choose(ctx, options, self.rng)
                prefill_choice.append(picked)
                return picked.chosen

            outcome = decide_pd(
                ctx,
                chosen,
                self._candidates(request, prefill_eps, now_s, pricing) if prefill_eps else [],
                choose_prefill,
                routing.pd,
            )
            decision.pd_reason = outcome.reason
            if outcome.prefill is not None and routing.pd.topology.aware:
                pair = self._pair(ctx, pool, choice, outcome.prefill, prefill_choice[0], routing.pd, pricing)
            else:
                pair = None
            if pair is not None:
                outcome = PDOutcome(pair.prefill, outcome.reason)
                if pair.decode is not chosen:
                    chosen = pair.decode
                    moved = Choice(
                        choice.candidates, choice.candidates.index(chosen), choice.totals, {}, choice.fallback
                    )
                    decision.reason = decision_reason(ctx, moved, candidates, routing.pipeline.uses_session)
                    decision.endpoint = chosen.endpoint
                    decision.cached_tokens_estimate = chosen.cached_tokens
                    decision.cached_tiers = chosen.tiers
                if debug:
                    decision.scores["pair"] = {"cost_s": pair.cost_s}
            if outcome.prefill is not None:
                decision.prefill_endpoint = outcome.prefill.endpoint
                decision.prefill_cached_tokens_estimate = outcome.prefill.cached_tokens
                decision.prefill_cached_tiers = outcome.prefill.tiers
            if debug and prefill_choice:
                decision.scores.update(prefill_choice[0].debug_scores(prefix="prefill:"))
        return decision

    def _pair(
        self,
        ctx: RouteContext,
        pool: Pool,
        decode_choice: Choice,
        prefill: Candidate,
        prefill_choice: Choice,
        pd: PDConfig,
        pricing: TierPricing,
    ) -> Pair | None:
        """The PD pair with the KV transfer over its link in its cost (`policies.routing.pd`);
        None when no decode or no prefill candidate carries topology labels (nothing to price)."""
        if not any(c.endpoint.topology.known for c in decode_choice.candidates) or not any(
            c.endpoint.topology.known for c in prefill_choice.candidates
        ):
            return None
        costs = self._pair_costs.get(pool.name)
        if costs is None:
            preset = pricing.preset or resolve_preset(pool.config.preset or DEFAULT_PRESET, pool.config.tensor_parallel)
            costs = self._pair_costs[pool.name] = PairCosts(preset, pd.topology.links)
        chosen = price(ctx, decode_choice.chosen, prefill, costs)
        decodes = list(zip(decode_choice.candidates, decode_choice.totals, strict=True))
        return choose_pair(
            ctx,
            decodes,
            chosen,
            prefill_choice.candidates,
            costs,
            pd.topology.decode_slack,
            pd.min_uncached_tokens,
            pd.max_prefill_backlog_tokens,
        )

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        routing = self._routing(decision.endpoint.pool)
        if routing.baseline is not None:
            routing.baseline.on_dispatch(request, decision)
            return
        now_s = decision.decided_at_s
        self._prompt_tokens += request.facts.prompt_tokens or 0
        tiers = decision.cached_tiers
        if tiers is not None and decision.prefill_endpoint is None:
            for i, n in enumerate(tiers.as_tuple()):
                self._tier_tokens[i] += n
        self.index.record(request.prompt, decision.endpoint, now_s)
        if decision.prefill_endpoint is not None:
            self.index.record(request.prompt, decision.prefill_endpoint, now_s)
        if request.adapter is not None:
            self.residency.record(decision.endpoint, request.adapter.name, request.adapter.size_bytes, now_s)
        key = session_key(request.facts, decision.endpoint.pool, self.config.session.use_user_field)
        self.sessions.pin(key, decision.endpoint.id)
        program = request.facts.subjects.program
        if program is not None:
            gap_s = self.tool_returns.returned_now(request.facts.principal.tenant, program, now_s)
            if gap_s is not None and self.tool_share is not None:
                self.tool_share.tool_returned(request.facts.principal.tenant, program, gap_s)
        if decision.pd_reason is not None:
            self._count_pd(decision, routing.pd)
        if self.dispatch_listener is not None:
            self.dispatch_listener(request.prompt, decision, key)

    def supply(self, decision: RouteDecision, prompt_tokens: int) -> KvSupply | None:
        """What the dispatch's cached prefix saved its pool and the KV bytes it moved
        (`policies.routing.kv_tiers`); None for a pool this router has not scored (baseline routers)."""
        meter = self._meters.get(decision.endpoint.pool)
        return meter.measure(decision, prompt_tokens) if meter is not None else None

    def engine_supply(self, decision: RouteDecision, cached_tokens: int) -> KvSupply | None:
        """What a dispatch without a prefill leg saved by its engine's own count of cached prompt
        tokens (`SupplyMeter.measure_engine`); None for a disaggregated one or an unscored pool."""
        if decision.prefill_endpoint is not None:
            return None
        meter = self._meters.get(decision.endpoint.pool)
        return meter.measure_engine(decision, cached_tokens) if meter is not None else None

    def note_tool_call(self, facts: RequestFacts, decision: RouteDecision, prefix_tokens: int, now_s: float) -> None:
        """The request's answer on `decision.endpoint` ended in tool calls (told by the gateway when
        its upstream call ended): its program is expected back there with `prefix_tokens` cached."""
        program = facts.subjects.program
        endpoint = decision.endpoint
        pipeline = self._routing(endpoint.pool).pipeline
        if program is None or pipeline is None or not pipeline.uses_tool_affinity:
            return  # the pool's routing does not weigh tool returns: nothing to keep
        self.tool_returns.note_tool_call(
            facts.principal.tenant, program, endpoint.pool, endpoint.id, prefix_tokens, now_s
        )
        if self.tool_share is not None:
            self.tool_share.tool_noted(facts.principal.tenant, program, endpoint, prefix_tokens, now_s)

    def on_remote_tool_call(
        self, tenant: str, program: str, endpoint: Endpoint, prefix_tokens: int, noted_s: float
    ) -> None:
        """Another gateway replica's answer on `endpoint` ended in tool calls at `noted_s` (this
        process's clock): the program's next turn, whichever replica receives it, goes back there."""
        self.tool_returns.note_tool_call(tenant, program, endpoint.pool, endpoint.id, prefix_tokens, noted_s)

    def on_remote_return(self, tenant: str, program: str, gap_s: float) -> None:
        """Another gateway replica dispatched `program`'s return, `gap_s` after its tool-call answer."""
        self.tool_returns.returned_elsewhere(tenant, program, gap_s)

    def on_remote_dispatch(self, endpoint: Endpoint, keys: Sequence[int], session: str | None) -> None:
        """Another gateway replica sent a prompt with these block keys (and session) to `endpoint`."""
        self.index.record_remote(endpoint, keys)
        if session is not None:
            self.sessions.pin(session, endpoint.id)

    # -- KV events and reporting ------------------------------------------------------------------

    def on_kv_batch(self, endpoint_id: str, batch: KvEventBatch) -> None:
        """`KvEventHub` batch callback (precise mode)."""
        self.index.on_kv_batch(endpoint_id, batch)

    def on_kv_reset(self, endpoint_id: str, reason: str) -> None:
        """`KvEventHub` reset callback: events were lost or the engine restarted."""
        self.index.on_kv_reset(endpoint_id, reason, time.monotonic())

    def on_store_batch(self, pool: str, batch: KvEventBatch) -> None:
        """Events of `pool`'s shared KV store (`kv_store`): its blocks count on every replica."""
        self.index.on_store_batch(pool, batch)

    def forget_endpoints_except(self, endpoint_ids: Collection[str]) -> None:
        """Call when the fleet changes: drop index state of endpoints that left."""
        self.index.retain(endpoint_ids)

    def report(self, now_s: float) -> RoutingReport:
        return RoutingReport(
            index=self.index.report(now_s),
            sessions=len(self.sessions),
            pd={k: PDCounters(v.served, v.disaggregated, v.warned) for k, v in self.pd_counters.items()},
            prompt_tokens=self._prompt_tokens,
            cached_tokens_by_tier=dict(zip(TIER_NAMES, self._tier_tokens, strict=True)),
        )

    # -- internals ----------------------------------------------------------------------------------

    def _routing(self, pool_name: str) -> _PoolRouting:
        routing = self._pools.get(pool_name)
        if routing is None:
            cfg = self.config.pipeline_for(pool_name)
            pd_cfg = self.config.pd_for(pool_name)
            if cfg.router == "scoring":
                routing = _PoolRouting(Pipeline.from_config(cfg), None, pd_cfg, Pipeline.from_config(pd_cfg.prefill))
            else:
                routing = _PoolRouting(None, components.BASELINE_ROUTERS[cfg.router](), pd_cfg, None)
            self._pools[pool_name] = routing
        return routing

    def _candidates(
        self, request: RouteRequest, endpoints: Sequence[Endpoint], now_s: float, pricing: TierPricing
    ) -> list[Candidate]:
        cached = self.index.lookup_tiers(request.prompt, endpoints, now_s)
        max_age_s = self.config.max_stats_age_s
        unscraped_pool = all(e.stats.scraped_at_s == 0.0 for e in endpoints)
        return [
            Candidate(
                e,
                pricing.visible(t),
                saturated=not unscraped_pool and e.stats_age_s(now_s) > max_age_s,
                tiers=t,
                credited_tokens=pricing.credited(t) if t.lower else None,
            )
            for e, t in zip(endpoints, cached, strict=True)
        ]

    def _count_pd(self, decision: RouteDecision, pd: PDConfig) -> None:
        pool = decision.endpoint.pool
        counters = self.pd_counters.get(pool)
        if counters is None:
            counters = self.pd_counters[pool] = PDCounters()
        counters.served += 1
        if decision.pd_reason == PD_DISAGGREGATED:
            counters.disaggregated += 1
        if not counters.warned and counters.disaggregated == 0 and counters.served >= pd.warn_after_requests:
            counters.warned = True
            log.warning(
                "PD pool %s served %d requests and disaggregated none: check prefill endpoints, "
                "pd.min_uncached_tokens (%d) and that kv_transfer_params reach the engines",
                pool,
                counters.served,
                pd.min_uncached_tokens,
            )


# What the router can hand a component, by the names components declare in `consumes`: endpoint state
# every pool has, and what exists only when it is configured (the prefix index, the predictor).
ALWAYS_AVAILABLE = frozenset(
    {
        "inflight",
        "inflight.prefill_tokens",
        "inflight.decode_tokens",
        "stats.running",
        "stats.waiting",
        "stats.kv_usage_ratio",
        "endpoint.max_model_len",
        "session",
        "slo",
        "running-tpot-slo",
        "stats.loras",
        "tool-returns",
    }
)
CONFIGURED = frozenset({"prefix-index", "predictions"})


def check_consumes(config: RoutingConfig, *, predictor: bool) -> list[str]:
    """Every configured component's declared inputs against what the router will have.

    An unknown name is a component bug (ValueError at start-up); an input that is known but not
    configured (the `latency` scorer without a predictor, `prefix-cache` with the index off) is
    returned as a warning: the component then scores every endpoint alike."""
    available = set(ALWAYS_AVAILABLE)
    if config.prefix_index.mode != "off":
        available.add("prefix-index")
    if predictor:
        available.add("predictions")
    pipelines = {"default": config.default, **{f"pools.{name}": config.pipeline_for(name) for name in config.pools}}
    pipelines["pd.prefill"] = config.pd.prefill  # unknown names only: it runs in PD pools alone
    warnings: list[str] = []
    for where, pipeline in pipelines.items():
        if pipeline.router != "scoring":
            continue
        specs = [("filter", f) for f in pipeline.filters] + [("scorer", s) for s in pipeline.scorers]
        for kind, spec in specs:
            for name in getattr(components.build(kind, spec.type, spec.params), "consumes", ()):
                if name not in ALWAYS_AVAILABLE and name not in CONFIGURED:
                    raise ValueError(f"routing.{where}: {kind} {spec.type!r} consumes unknown input {name!r}")
                if name not in available and where != "pd.prefill":
                    warnings.append(f"routing.{where}: {kind} {spec.type!r} needs {name!r}, which is not configured")
    return warnings


def tool_returns(config: ToolAffinityConfig) -> ToolReturns:
    """The router's pending-returns table from `routing.tool_affinity`."""
    learner = GapLearner(
        window=config.window,
        quantile=config.quantile,
        min_samples=config.min_samples,
        min_ttl_s=config.min_ttl_s,
        max_ttl_s=config.max_ttl_s,
        default_ttl_s=config.default_ttl_s,
        max_tenants=config.max_tenants,
    )
    return ToolReturns(learner, max_programs_per_tenant=config.max_programs_per_tenant)


def build_router(
    config: RoutingConfig | Mapping[str, Any] | None = None,
    *,
    engine_hashers: Mapping[str, EngineHasher] | None = None,
    rng: random.Random | None = None,
    predictor: LatencyPredictor | None = None,
) -> ScoringRouter:
    """The gateway's router from gateway.yaml's `routing:` section (a dict, a model, or None for defaults).

    `engine_hashers` (engine kind -> hasher) overrides which engines the precise index matches by
    their own block hashes (default `prefix_blocks.ENGINE_HASHERS`, see `prefix_precise.py`);
    `rng` overrides `config.seed` for the pickers' random choices. `predictor` (None: disabled)
    predicts the candidates for the `latency` scorer and the gateway's SLO gate.
    """
    if config is None:
        cfg = RoutingConfig()
    elif isinstance(config, RoutingConfig):
        cfg = config
    else:
        cfg = RoutingConfig.model_validate(dict(config))
    for warning in check_consumes(cfg, predictor=predictor is not None):
        log.warning("%s: it scores every endpoint alike", warning)
    return ScoringRouter(
        config=cfg,
        index=PrefixIndex(
            cfg.prefix_index,
            engine_hashers=engine_hashers,
            offload_tokens_of=lambda pool: cfg.kv_tiers_for(pool).offload_capacity_tokens,
        ),
        sessions=SessionTable(cfg.session.max_sessions),
        tool_returns=tool_returns(cfg.tool_affinity),
        rng=rng or random.Random(cfg.seed),
        predictor=predictor,
    )


MAX_SESSION_KEY_CHARS = 64


def bounded_key(key: str) -> str:
    """`key` itself when short and valid text, else '#' + its 128-bit hash (32 hex characters)."""
    if len(key) <= MAX_SESSION_KEY_CHARS:
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            pass
        else:
            return key
    return "#" + xxhash.xxh3_128_hexdigest(key.encode("utf-8", "surrogateescape"))


def session_key(facts: RequestFacts, pool: str, use_user_field: bool) -> str | None:
    """The request's session in one pool: `RequestFacts.session_key` (a header), else the OpenAI
    `user` field. Keyed per pool so a session that falls back to another model keeps both pins."""
    key = facts.session_key
    if key is None and use_user_field:
        user = facts.body.get("user")
        if isinstance(user, str) and user:
            key = user
    return f"{pool}\x00{bounded_key(key)}" if key else None


class SessionTable:
    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._pins: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def key_chars(self) -> int:
        """Characters held by the session keys (each a bounded `session_key`): memory, not count."""
        return sum(map(len, self._pins))

    def get(self, key: str | None) -> str | None:
        return self._pins.get(key) if key is not None else None

    def pin(self, key: str | None, endpoint_id: str) -> None:
        if key is None:
            return
        pins = self._pins
        if key in pins:
            pins.move_to_end(key)
        pins[key] = endpoint_id
        while len(pins) > self.max_sessions:
            pins.popitem(last=False)

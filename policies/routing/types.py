"""Routing vocabulary: the router contract the gateway calls, the decision it gets back, and the small
protocols the scoring pipeline is built from (filters, scorers, pickers).

A router is synchronous and side-effect free in `route` (a function of the request's routing
inputs, the pool's endpoints as they are now, and its own state: it changes none of them beyond the
request's own hash memo); `on_dispatch` records what was sent where (prefix-index insertions,
session pins) once the gateway has committed to the decision.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Protocol

from backends.fleet import LoraAdapter, Pool
from backends.types import Endpoint
from policies.routing.kv_tiers import TierTokens
from policies.routing.prefix_blocks import HashedPrompt
from policies.types import RequestFacts
from predictor.features import Prediction

if TYPE_CHECKING:
    from policies.routing.lora import AdapterResidency
    from policies.routing.tool_affinity import PendingReturn

NO_RUNNING_SLOS: Final[Mapping[str, float]] = MappingProxyType({})
NO_RESERVED_TOKENS: Final[Mapping[str, int]] = MappingProxyType({})


def _no_running_slos() -> Mapping[str, float]:
    return NO_RUNNING_SLOS


def _no_reserved_tokens() -> Mapping[str, int]:
    return NO_RESERVED_TOKENS


# Metric label values of `RouteDecision.reason`.
REASON_PREFIX_HIT = "prefix-hit"  # chosen endpoint holds the longest cached prefix of the prompt
REASON_LOAD = "load"  # chosen for load: no useful prefix anywhere, or its holder was too busy
REASON_SESSION = "session"  # chosen because the session is pinned to it
REASON_TOOL_RETURN = "tool-return"  # a program back from a tool call, on the replica holding its prefix
REASON_ONLY = "only"  # a single candidate
REASON_FALLBACK = "fallback"  # filters (or stale stats) rejected every candidate; chose among all

# Metric label values of `RouteDecision.pd_reason` (disaggregated pools only).
PD_DISABLED = "disabled"  # PD turned off for the pool: the decode endpoint prefills everything
PD_DISAGGREGATED = "disaggregated"  # prefill leg on `prefill_endpoint`, decode on `endpoint`
PD_FEW_UNCACHED = "few-uncached"  # uncached tokens on the decode endpoint under the threshold
PD_NO_PREFILL = "no-prefill-endpoint"  # no ready prefill endpoint: prefill and decode on `endpoint`
PD_PREFILL_BUSY = "prefill-busy"  # every prefill endpoint's backlog is over the limit
PD_CONVERTED = "prefill-backlog"  # prefill backed up, the decode endpoint had headroom: it prefilled


@dataclass(slots=True)
class RouteRequest:
    """What a router reads of one request: its facts and what the gateway learnt for routing it.

    `running_tpot_slo_ms` (endpoint id -> the tightest TPOT SLO of the requests running there, a
    live mapping kept by the gateway's SLO hook) lets the latency scorer protect running requests.
    `prompt` holds the engine's own token ids when the gateway asked for them, and the prompt's
    block hashes once computed.
    """

    facts: RequestFacts
    running_tpot_slo_ms: Mapping[str, float] = field(default_factory=_no_running_slos)
    prompt: HashedPrompt = field(init=False)
    adapter: LoraAdapter | None = None  # the LoRA adapter the model being tried is (docs/adapters.md)

    def __post_init__(self) -> None:
        self.prompt = HashedPrompt(self.facts)

    def use_engine_token_ids(self, token_ids: Sequence[int] | None) -> None:
        """Hash the engine's own ids from now on (None: the gateway's); a change starts a new memo."""
        if token_ids is not self.prompt.engine_token_ids:
            self.prompt = HashedPrompt(self.facts, token_ids, lora=self.prompt.lora)

    def use_adapter(self, adapter: LoraAdapter | None) -> None:
        """Route (and hash) as the LoRA `adapter` from now on (None: the base model); a change starts
        a new memo, as the engine salts an adapter's blocks by its name."""
        self.adapter = adapter
        lora = adapter.name if adapter is not None else None
        if lora != self.prompt.lora:
            self.prompt = HashedPrompt(self.facts, self.prompt.engine_token_ids, lora=lora)


@dataclass(slots=True)
class RouteDecision:
    endpoint: Endpoint  # serves the request (the decode endpoint in a disaggregated pool)
    reason: str  # metrics label: prefix-hit | load | session | only | fallback
    prefill_endpoint: Endpoint | None = None  # set when the request is disaggregated
    cached_tokens_estimate: int = 0  # prompt tokens expected to hit the prefix cache on `endpoint`
    cached_tiers: TierTokens | None = None  # the same per KV tier (HBM, DRAM, disk, remote), when known
    prefill_cached_tokens_estimate: int = 0  # same, on `prefill_endpoint`
    prefill_cached_tiers: TierTokens | None = None  # its split per KV tier, when known
    pd_reason: str | None = None  # disaggregated pools: why (not) disaggregated; None elsewhere
    decided_at_s: float = 0.0  # `now_s` of the route call (speculative index entries start here)
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # endpoint id -> scorer -> score
    # every candidate's latency prediction when the router made them (the latency scorer or an SLO),
    # by endpoint id: the SLO gate decides over them and the predictor learns from the chosen one's
    predictions: Mapping[str, Prediction] | None = None

    @property
    def prediction(self) -> Prediction | None:
        """The serving endpoint's prediction, when the router made one."""
        return self.predictions.get(self.endpoint.id) if self.predictions is not None else None

    @property
    def disaggregated(self) -> bool:
        return self.prefill_endpoint is not None

    @property
    def cached_lower_tokens(self) -> int:
        """Of `cached_tokens_estimate`, the tokens expected from tiers below HBM (loaded, not computed):
        the latency predictor's per-tier feature."""
        tiers = self.cached_tiers
        return max(self.cached_tokens_estimate - tiers.gpu, 0) if tiers is not None else 0

    def uncached_prefill_tokens(self, prompt_tokens: int) -> int:
        """Prompt tokens the engine will compute: what `InFlight.begin` should count on the prefill side."""
        cached = self.prefill_cached_tokens_estimate if self.disaggregated else self.cached_tokens_estimate
        return max(prompt_tokens - cached, 0)

    def debug_header(self) -> str:
        """Compact `x-tokenway-route` value: reason and per-endpoint scores."""
        parts = [f"reason={self.reason}", f"endpoint={self.endpoint.id}", f"cached={self.cached_tokens_estimate}"]
        if self.pd_reason is not None:
            parts.append(f"pd={self.pd_reason}")
        if self.prefill_endpoint is not None:
            parts.append(f"prefill={self.prefill_endpoint.id}")
        for endpoint_id, by_scorer in self.scores.items():
            inner = ",".join(f"{k}:{v:.3f}" for k, v in by_scorer.items())
            parts.append(f"{endpoint_id}=[{inner}]")
        return "; ".join(parts)


class Router(Protocol):
    def route(
        self, request: RouteRequest, pool: Pool, now_s: float, exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        """Choose an endpoint among the pool's ready ones not in `exclude`; None when there is none."""
        ...

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        """The gateway sent the request as decided: update indexes and affinities."""
        ...


# --- the scoring pipeline's vocabulary -------------------------------------------------------------


@dataclass(slots=True)
class Candidate:
    """One endpoint as the pipeline sees it for one request.

    `cached_tokens` is the prefix index's estimate of this prompt's tokens already in the endpoint's KV
    cache, every tier the pool's tier credit sees (real tokens: the engine will not compute them);
    `tiers` splits them per KV tier and `credited_tokens` is what they are worth in prefill-token
    equivalents once loading from the lower tiers is paid (`kv_tiers.py`; None: `cached_tokens`).
    `saturated` is set by the framework when the endpoint's scraped stats are older than
    `max_stats_age_s`: such an endpoint is only chosen when every candidate is saturated.
    """

    endpoint: Endpoint
    cached_tokens: int = 0
    saturated: bool = False
    tiers: TierTokens | None = None
    credited_tokens: float | None = None

    @property
    def credited(self) -> float:
        """Prefill-token equivalents the cached prefix saves (`cached_tokens` without tier pricing)."""
        return self.cached_tokens if self.credited_tokens is None else self.credited_tokens

    @property
    def id(self) -> str:
        return self.endpoint.id


@dataclass(slots=True)
class RouteContext:
    """The request-level inputs every filter, scorer and picker of one decision shares."""

    facts: RequestFacts
    now_s: float
    prompt_tokens: int
    session_endpoint_id: str | None = None  # where the request's session is pinned, if anywhere
    predictions: Mapping[str, Prediction] | None = None  # by endpoint id, when the router made them
    running_tpot_slo_ms: Mapping[str, float] = field(default_factory=_no_running_slos)  # see `RouteRequest`
    adapter: LoraAdapter | None = None  # the LoRA adapter asked for (`RouteRequest.adapter`)
    residency: AdapterResidency | None = None  # which adapters the router sent where (`routing/lora.py`)
    lora_budget_bytes: int | None = None  # the pool's LoRA memory budget per replica (None: slots alone)
    # tool-boundary affinity (`routing/tool_affinity.py`), filled when the pipeline has `tool-affinity`:
    # this program's pending return after a tool call, and every endpoint's tokens of pending returns
    tool_return: PendingReturn | None = None
    reserved_tokens: Mapping[str, int] = field(default_factory=_no_reserved_tokens)

    def uncached_tokens(self, candidate: Candidate) -> int:
        """Prompt tokens the endpoint would compute (real tokens: lower-tier hits are loaded, not computed)."""
        return max(self.prompt_tokens - candidate.cached_tokens, 0)

    def uncached_work(self, candidate: Candidate) -> float:
        """The request's own prefill work on the endpoint in prefill-token equivalents: its uncached
        tokens plus the time to load its lower-tier hits, priced as the prefill it would replace."""
        return max(self.prompt_tokens - candidate.credited, 0.0)


class Filter(Protocol):
    """Removes candidates that must not serve the request. An empty result makes the framework fall
    back to the unfiltered candidates (reason `fallback`)."""

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    """Scores every candidate in [0, 1], higher is better; the framework clamps and weights the scores.

    Scoring is batched because most formulas are relative to the other candidates (best = 1).
    """

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]: ...


class Picker(Protocol):
    """Chooses the index of one candidate from the weighted totals (same order as `candidates`)."""

    def pick(
        self, ctx: RouteContext, candidates: Sequence[Candidate], totals: Sequence[float], rng: random.Random
    ) -> int: ...

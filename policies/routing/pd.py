"""Prefill/decode disaggregation: per request, whether a separate prefill leg pays off, where, and
which prefill/decode pair (topology-aware pairing).

The decision. The decode endpoint is chosen first (by the pool's pipeline, over decode and mixed
endpoints): it holds the request for all of its output, and its cache decides how much prefill is
left. Then:

    uncached = prompt_tokens - cached_tokens(decode endpoint)
    uncached <  min_uncached_tokens  -> prefill on the decode endpoint   (few-uncached)
    no ready prefill endpoint        -> prefill on the decode endpoint   (no-prefill-endpoint)
    else choose a prefill endpoint by prefix and prefill load (the PD prefill pipeline);
    its pending prefill > max_prefill_backlog_tokens -> prefill locally  (prefill-busy)
    convertible, its pending prefill > backlog_tokens and the decode endpoint has headroom
      (KV use <= max_kv_usage, own pending prefill <= max_pending_prefill_tokens)
                                                     -> prefill locally  (prefill-backlog)
    else                                             -> two legs          (disaggregated)

Convertible decoders (TokenScale, arXiv 2512.03416): during a prefill burst a decode replica with
headroom prefills instead of queueing the prompt behind a backed-up prefill replica, while the
autoscaler starts (or converts) prefill replicas for a burst that lasts.

A short uncached remainder costs less to compute in place than to transfer (an extra hop and a KV
copy), which is why a conversation's follow-up turns usually stay on their decode endpoint.
`min_uncached_tokens: 0` disaggregates every request that has a prefill endpoint.

Topology-aware pairing: a prefill/decode pair costs its prefill plus the KV transfer between them.
A disaggregated request's first token waits for the prefill leg, then for its KV to cross from the
prefill replica to the decode replica. A topology-blind router picks the two independently, so in a
two-rack fleet about half the pairs cross the spine, which may be ten times slower than a rack's
switch (the NetKV idea issue 42 names). Here the pair is chosen with that transfer in its cost, all
in seconds:

    prefill_s(p)     = roofline step time of [p's pending prefill tokens at context 0,
                                              the request's uncached tokens on p after its cached ones]
                       (the pool's preset, backends/perf/roofline.py; s)
    transfer_s(p, d) = latency_link (s) + tokens x kv_bytes_per_token_per_device (B)
                       / bandwidth_link (B/s per device)
                       tokens: the prompt tokens d does not already hold (its cached prefix stays;
                       the simulated engine's decode leg reserves and pulls only the rest)
    cost(p, d)       = prefill_s(p) + transfer_s(p, d)

over the decode endpoints whose pipeline total is within `decode_slack` of the best (the pipeline's
own choice always among them; others only if their own uncached tokens still call for a prefill leg)
and the prefill endpoints the prefill pipeline kept (its filters passed, backlog within
`max_prefill_backlog_tokens`). The cheapest pair wins; the pipelines' own pair keeps ties. `link`
is the link class of the two endpoints' labels (`backends.types.link_class`); when no pair has
one (endpoints without labels) nothing changes: the router is topology-blind as before.

KV bytes per token is per device (under tensor parallelism each GPU sends its own shard over its own
link), the same figure the tier credit uses (`backends.perf.roofline`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backends.perf.presets import Preset
from backends.perf.roofline import kv_bytes_per_token_per_device, step_cost
from backends.types import LINK_CLASSES, link_class
from policies.routing.config import ConvertibleConfig, LinkClassesConfig, PDConfig
from policies.routing.types import (
    PD_CONVERTED,
    PD_DISABLED,
    PD_DISAGGREGATED,
    PD_FEW_UNCACHED,
    PD_NO_PREFILL,
    PD_PREFILL_BUSY,
    Candidate,
    RouteContext,
)


@dataclass(frozen=True, slots=True)
class PDOutcome:
    prefill: Candidate | None  # None: the decode endpoint prefills itself
    reason: str  # PD_* label


def decide_pd(
    ctx: RouteContext,
    decode: Candidate,
    prefill_candidates: Sequence[Candidate],
    choose_prefill: Callable[[Sequence[Candidate]], Candidate],
    config: PDConfig,
) -> PDOutcome:
    """The PD decision for one request whose decode endpoint is `decode` (pure; see module doc)."""
    if not config.enabled:
        return PDOutcome(None, PD_DISABLED)
    if ctx.uncached_tokens(decode) < config.min_uncached_tokens:
        return PDOutcome(None, PD_FEW_UNCACHED)
    others = [c for c in prefill_candidates if c.id != decode.id]
    if not others:
        return PDOutcome(None, PD_NO_PREFILL)
    prefill = choose_prefill(others)
    limit = config.max_prefill_backlog_tokens
    backlog = prefill.endpoint.inflight.prefill_tokens
    if limit is not None and backlog > limit:
        return PDOutcome(None, PD_PREFILL_BUSY)
    convertible = config.convertible
    if convertible is not None and backlog > convertible.backlog_tokens and _headroom(decode, convertible):
        return PDOutcome(None, PD_CONVERTED)
    return PDOutcome(prefill, PD_DISAGGREGATED)


def _headroom(decode: Candidate, convertible: ConvertibleConfig) -> bool:
    endpoint = decode.endpoint
    return (
        endpoint.stats.kv_usage_ratio <= convertible.max_kv_usage
        and endpoint.inflight.prefill_tokens <= convertible.max_pending_prefill_tokens
    )


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth_bytes_per_s: float
    latency_s: float


class PairCosts:
    """Prices a PD pair in seconds on one pool (pure: the preset and the link classes)."""

    def __init__(self, preset: Preset, links: LinkClassesConfig) -> None:
        self.preset = preset
        self.kv_bytes_per_token = kv_bytes_per_token_per_device(preset)
        self.links = {
            name: Link(getattr(links, name).bandwidth_gbps * 1e9, getattr(links, name).latency_ms / 1e3)
            for name in LINK_CLASSES
        }

    def transfer_s(self, link: str | None, tokens: int) -> float:
        """Seconds to move `tokens` of KV over a link of class `link` (0 without a class or tokens)."""
        if link is None or tokens <= 0:
            return 0.0
        c = self.links[link]
        return c.latency_s + tokens * self.kv_bytes_per_token / c.bandwidth_bytes_per_s

    def prefill_s(self, pending_tokens: int, uncached_tokens: int, cached_tokens: int) -> float:
        """Seconds until a prefill endpoint with `pending_tokens` queued has computed this request."""
        chunks = [(n, ctx) for n, ctx in ((pending_tokens, 0), (uncached_tokens, cached_tokens)) if n > 0]
        return step_cost(self.preset, chunks).total_s if chunks else 0.0


@dataclass(frozen=True, slots=True)
class Pair:
    decode: Candidate
    prefill: Candidate
    cost_s: float
    link: str | None


def choose_pair(
    ctx: RouteContext,
    decodes: Sequence[tuple[Candidate, float]],
    chosen: Pair,
    prefills: Sequence[Candidate],
    costs: PairCosts,
    slack: float,
    min_uncached_tokens: int,
    max_prefill_backlog_tokens: int | None,
) -> Pair:
    """The cheapest pair (module doc); `decodes` are the decode candidates with their pipeline totals,
    `chosen` the pipelines' own pair (priced by the caller with `price`)."""
    if not decodes or not prefills:
        return chosen
    best_total = max(t for _, t in decodes)
    options = [
        d
        for d, t in decodes
        if d.id == chosen.decode.id or (t >= best_total - slack and ctx.uncached_tokens(d) >= min_uncached_tokens)
    ]
    ready = [
        p
        for p in prefills
        if max_prefill_backlog_tokens is None or p.endpoint.inflight.prefill_tokens <= max_prefill_backlog_tokens
    ]
    prefill_s = {p.id: _prefill_s(ctx, p, costs) for p in ready}
    best = chosen
    labelled = chosen.link is not None
    for d in options:
        for p in ready:
            if p.id == d.id:
                continue
            pair = _pair(ctx, d, p, prefill_s[p.id], costs)
            labelled = labelled or pair.link is not None
            if pair.cost_s < best.cost_s - 1e-12:
                best = pair
    return best if labelled else chosen


def price(ctx: RouteContext, decode: Candidate, prefill: Candidate, costs: PairCosts) -> Pair:
    """One pair with its cost (module doc)."""
    return _pair(ctx, decode, prefill, _prefill_s(ctx, prefill, costs), costs)


def _prefill_s(ctx: RouteContext, p: Candidate, costs: PairCosts) -> float:
    return costs.prefill_s(max(p.endpoint.inflight.prefill_tokens, 0), ctx.uncached_tokens(p), p.cached_tokens)


def _pair(ctx: RouteContext, d: Candidate, p: Candidate, prefill_s: float, costs: PairCosts) -> Pair:
    link = link_class(p.endpoint.topology, d.endpoint.topology)
    moved = ctx.uncached_tokens(d)  # the decode endpoint pulls the prompt's blocks it does not hold
    return Pair(d, p, prefill_s + costs.transfer_s(link, moved), link)

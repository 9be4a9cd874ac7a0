"""Prefill/decode disaggregation: per request, whether a separate prefill leg pays off, and where.

The decode endpoint is chosen first (by the pool's pipeline, over decode and mixed endpoints): it
holds the request for all of its output, and its cache decides how much prefill is left. Then:

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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backends.fleet import Pool
from backends.types import Role
from policies.routing.config import ConvertibleConfig, PDConfig
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


def is_disaggregated(pool: Pool) -> bool:
    """A pool is disaggregated when any endpoint (ready or not) has the prefill or decode role."""
    return pool.disaggregated or any(e.role is not Role.BOTH for e in pool.endpoints)


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

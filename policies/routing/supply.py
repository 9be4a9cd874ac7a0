"""The supply side of a dispatch: what the KV cache saved the pool, and the KV bytes it moved.

Cost per million tokens has two sides: what a tenant is charged (the price table) and what serving
cost the pool. A cached prefix lowers the second: its tokens are not recomputed, so the replica's
GPUs spend less time on the prefill. Issue 42 asks for that saving in tokens, in GPU-seconds and in
dollars, and for the KV bytes the cache moves over each link; the gateway's metrics read them from
here (`ScoringRouter.supply`, counted by `gateway/transport/observers.py`).

Per dispatch, with the serving endpoint's cached tokens per tier (the prefill endpoint's when the
request is disaggregated: that is where the prompt is computed), under the pool's tier credit:

    real_tokens     = cached tokens of the tiers the credit sees (the engine will not compute them)
    credited_tokens = the credit's prefill-token equivalents (`TierPricing.credited`)
    prefill_s       = compute_s(gpu run at context 0)
                      + sum over lower-tier runs of max(compute_s(run at its context) - load_s(run), 0)
                      (roofline compute of the pool's preset, backends/perf/roofline.py; load_s over the
                      tier's link, as the physics credit prices it, whatever the credit mode)
    gpu_seconds     = prefill_s x tensor_parallel (every GPU of the replica is busy for the step)
    usd             = gpu_seconds x usd_per_gpu_hour / 3600, when the pool sets `usd_per_gpu_hour`

KV bytes moved (all the replica's devices: bytes per token per device x tensor_parallel):
lower-tier loads, per tier (`cpu`, `disk`, `remote`: the tier's tokens), and a disaggregated
request's transfer from its prefill to its decode endpoint, per link class of the pair
(`backends.topology.link_class`; `unknown` when either endpoint has no labels): the prompt tokens
the decode endpoint does not hold already, as `policies.routing.topology` prices it.

These are the router's expectations at dispatch (the index's estimate), not the engines' counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from backends.perf.capacity import kv_bytes_per_token_per_device
from backends.perf.presets import Preset
from backends.perf.roofline import step_cost
from backends.topology import link_class
from policies.routing.prefix.tiers import CPU, DISK, GPU_ONLY, REMOTE, TIER_NAMES, TierPricing, TierTokens
from policies.routing.types import RouteDecision

UNKNOWN_LINK: Final = "unknown"  # a PD pair whose endpoints carry no topology labels


@dataclass(frozen=True, slots=True)
class KvSupply:
    """What one dispatch's cached prefix saved, and the KV bytes it moved (module doc)."""

    real_tokens: int = 0
    credited_tokens: float = 0.0
    gpu_seconds: float = 0.0
    usd: float | None = None  # None: the pool has no `usd_per_gpu_hour`
    bytes_by_link: tuple[tuple[str, int], ...] = ()


class SupplyMeter:
    """Measures dispatches of one pool (pure: the preset, the tier links, the pool's GPU price).

    `credit` is the pool's routing credit (which tiers count, what a token is worth); `physics` the
    same tiers priced by load time, which the GPU-seconds use whatever the credit mode."""

    def __init__(
        self, preset: Preset, credit: TierPricing, physics: TierPricing, usd_per_gpu_hour: float | None
    ) -> None:
        self.preset = preset
        self.credit = credit
        self.physics = physics
        self.usd_per_gpu_hour = usd_per_gpu_hour
        self.kv_bytes_per_token = kv_bytes_per_token_per_device(preset) * preset.tp

    def measure(self, decision: RouteDecision, prompt_tokens: int) -> KvSupply:
        if decision.prefill_endpoint is not None:
            tiers = decision.prefill_cached_tiers or TierTokens(gpu=decision.prefill_cached_tokens_estimate)
        else:
            tiers = decision.cached_tiers or TierTokens(gpu=decision.cached_tokens_estimate)
        if self.credit.mode == GPU_ONLY:
            tiers = TierTokens(gpu=tiers.gpu)
        moved: list[tuple[str, int]] = []
        seconds = step_cost(self.preset, [(tiers.gpu, 0)]).compute_s if tiers.gpu > 0 else 0.0
        start = tiers.gpu
        for tier, n in ((CPU, tiers.cpu), (DISK, tiers.disk), (REMOTE, tiers.remote)):
            if n <= 0:
                continue
            compute_s = step_cost(self.preset, [(n, start)]).compute_s
            seconds += max(compute_s - self.physics.load_s(tier, n), 0.0)
            moved.append((TIER_NAMES[tier], n * self.kv_bytes_per_token))
            start += n
        prefill = decision.prefill_endpoint
        if prefill is not None:
            pulled = max(prompt_tokens - decision.cached_tokens_estimate, 0)
            if pulled:
                link = link_class(prefill.topology, decision.endpoint.topology) or UNKNOWN_LINK
                moved.append((link, pulled * self.kv_bytes_per_token))
        gpu_seconds = seconds * self.preset.tp
        usd = gpu_seconds * self.usd_per_gpu_hour / 3600.0 if self.usd_per_gpu_hour is not None else None
        return KvSupply(tiers.total, self.credit.credited(tiers), gpu_seconds, usd, tuple(moved))

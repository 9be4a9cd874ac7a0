"""KV-cache tiers: how many of a prompt's cached tokens sit in each tier, what a hit there is worth to
routing (`TierPricing`), and what a dispatch's cached prefix saved the pool (`SupplyMeter`).

An engine's prefix cache is no longer HBM alone: vLLM's offloading connector and LMCache keep evicted
(or copied) blocks in host DRAM, on local disk or in a remote store, and publish them in the KV events
with their `medium` (`BlockStored.medium`: "GPU", "CPU", ...). A hit in a lower tier is not free: the
blocks must be loaded back over PCIe, NVMe or the network before the request's prefill continues.

Tiers, fastest first: `gpu` (medium GPU), `cpu` (CPU), `disk` (DISK / STORAGE), `remote` (any other
medium: a shared store). `TierTokens` counts real prompt tokens per tier (never weighted), as vLLM would
serve them: the leading run of blocks in HBM, then the run that follows in the lower tiers.

Credit (`TierPricing.credited`): the prefill-token equivalents a hit saves, so the work-cost scorer can
weigh it against a busy endpoint's backlog in one unit. For a run of n tokens of tier t that starts
after `start` tokens of context:

    compute_s = prefill compute of those n tokens at that context   (roofline of the pool's preset, s)
    load_s    = latency_t + n x kv_bytes_per_token_per_device / bandwidth_t      (s)
    credit    = n x clamp((compute_s - load_s) / compute_s, 0, 1)   (prefill-token equivalents)

so a DRAM hit on a long prefix is worth almost a GPU hit (attention makes its compute grow with the
context, its load does not) and a slow remote hit on a short prefix is worth nothing. GPU hits count
n. Other modes: `constant` (fixed weights per tier, default 1.0 / 0.75 / 0.25: the values issue 42
attributes to Dynamo, not checked against its docs here), `flat` (every tier 1: the index before
tiers, which ignored the medium), `gpu-only` (lower tiers invisible: a router that knows HBM only).

Supply: the supply side of a dispatch, what the KV cache saved the pool, and the KV bytes it moved.

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
(`backends.types.link_class`; `unknown` when either endpoint has no labels): the prompt tokens
the decode endpoint does not hold already, as `policies.routing.pd` prices it (`PairCosts`).

These are the router's expectations at dispatch (the index's estimate). The same saving measured
by the engine (`SupplyMeter.measure_engine`) prices instead the cached tokens the engine reported in
the answer's usage (`prompt_tokens_details.cached_tokens`, `cache_read_input_tokens`): the engine's
count, laid over the router's tiers in prompt order (`TierTokens.engine_split`: HBM first, then the
lower tiers, each up to the router's expectation; tokens the router did not expect continue the
deepest tier it expected, or HBM), through the same formula. The engine does not say which tier
served a token, so the tier split stays the router's; the total is the engine's. A disaggregated
request has none (its legs' usage is the decode engine's, whose prompt came over the link).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from backends.perf.presets import Preset
from backends.perf.roofline import kv_bytes_per_token_per_device, prefill_compute
from backends.types import link_class

if TYPE_CHECKING:  # types.py imports TierTokens from here
    from policies.routing.types import RouteDecision


TIER_NAMES: Final = ("gpu", "cpu", "disk", "remote")
GPU, CPU, DISK, REMOTE = 0, 1, 2, 3

# The precise index's medium bits (precise._MEDIUM_BITS: GPU 1, CPU 2, DISK/STORAGE 4, other 8) -> tier.
MEDIUM_BIT_TIERS: Final = ((1, GPU), (2, CPU), (4, DISK), (8, REMOTE))
LOWER_TIER_BITS: Final = 2 | 4 | 8


def lower_tier_of(bits: int) -> int:
    """The fastest lower tier (cpu, disk, remote) a block's medium bits hold; -1 if none."""
    if bits & 2:
        return CPU
    if bits & 4:
        return DISK
    if bits & 8:
        return REMOTE
    return -1


@dataclass(frozen=True, slots=True)
class TierTokens:
    """Cached prompt tokens per tier on one endpoint: `gpu` leads, the lower tiers follow it."""

    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    remote: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.disk + self.remote

    @property
    def lower(self) -> int:
        return self.cpu + self.disk + self.remote

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.gpu, self.cpu, self.disk, self.remote)

    @classmethod
    def from_blocks(cls, blocks_per_tier: list[int], tokens_per_block: int, cached_tokens: int) -> TierTokens:
        """Blocks per tier (in prompt order gpu, then lower tiers) -> tokens, the last run trimmed so the
        total is `cached_tokens` (the engine always computes the prompt's last token)."""
        out = [n * tokens_per_block for n in blocks_per_tier]
        excess = sum(out) - cached_tokens
        for tier in (REMOTE, DISK, CPU, GPU):  # the deepest run is the prompt's tail
            if excess <= 0:
                break
            cut = min(out[tier], excess)
            out[tier] -= cut
            excess -= cut
        return cls(out[0], out[1], out[2], out[3])

    def engine_split(self, cached_tokens: int) -> TierTokens:
        """`cached_tokens` (the engine's count) laid over these tiers in prompt order: each tier up to
        its own count, the excess on the deepest non-empty tier (HBM when none)."""
        out = [0, 0, 0, 0]
        left = max(cached_tokens, 0)
        deepest = GPU
        for tier, n in enumerate(self.as_tuple()):
            if n > 0:
                deepest = tier
            take = min(n, left)
            out[tier] = take
            left -= take
        out[deepest] += left
        return TierTokens(out[0], out[1], out[2], out[3])


GPU_ONLY: Final = "gpu-only"
FLAT: Final = "flat"
CONSTANT: Final = "constant"
PHYSICS: Final = "physics"


@dataclass(frozen=True, slots=True)
class TierLink:
    """How a tier is reached: bandwidth per device (bytes/s) and a fixed latency per load (s)."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0


class ChunkCompute:
    """The roofline's compute seconds of one prefill chunk of `new_tokens` after `context` cached ones,
    `step_cost(preset, [(new_tokens, context)]).compute_s`, with its constants taken once per preset
    (`prefill_compute`): routing and the supply meter price chunks on every request without building
    a step, and the roofline stays off the request's walk."""

    __slots__ = ("per_chunk_s", "per_pair_s", "per_token_s")

    def __init__(self, preset: Preset) -> None:
        self.per_token_s, self.per_chunk_s, self.per_pair_s = prefill_compute(preset)

    def __call__(self, new_tokens: int, context: int) -> float:
        pairs = new_tokens * (context + (new_tokens + 1) / 2)
        return self.per_token_s * new_tokens + self.per_chunk_s + self.per_pair_s * pairs


class TierPricing:
    """What a hit on each tier is worth on one pool, in prefill-token equivalents (see module doc).

    `visible(tiers)` is the real token count routing sees under the mode (`gpu-only` hides lower tiers);
    `credited(tiers)` the tokens a hit is worth. Both are pure functions of the preset and the links.
    """

    def __init__(
        self,
        mode: str,
        *,
        preset: Preset | None = None,
        links: tuple[TierLink, TierLink, TierLink] | None = None,
        constant: tuple[float, float, float, float] = (1.0, 0.75, 0.25, 0.25),
    ) -> None:
        if mode == PHYSICS and (preset is None or links is None):
            raise ValueError("physics credit needs the pool's preset and the tier links")
        self.mode = mode
        self.preset = preset
        self.links = links
        self.constant = constant
        self.kv_bytes_per_token = kv_bytes_per_token_per_device(preset) if preset is not None else 0
        self._compute_s = ChunkCompute(preset) if preset is not None else None

    def visible(self, tiers: TierTokens) -> int:
        return tiers.gpu if self.mode == GPU_ONLY else tiers.total

    def credited(self, tiers: TierTokens) -> float:
        if not tiers.lower or self.mode in (FLAT, GPU_ONLY):
            return float(self.visible(tiers))
        if self.mode == CONSTANT:
            c = self.constant
            return tiers.gpu * c[0] + tiers.cpu * c[1] + tiers.disk * c[2] + tiers.remote * c[3]
        credit = float(tiers.gpu)
        start = tiers.gpu
        for tier, n in ((CPU, tiers.cpu), (DISK, tiers.disk), (REMOTE, tiers.remote)):
            if n:
                credit += n * self.run_credit(tier, start, n)
                start += n
        return credit

    def run_credit(self, tier: int, start: int, n: int) -> float:
        """The share in [0, 1] of a run's prefill that loading it from `tier` saves."""
        if tier == GPU:
            return 1.0
        assert self._compute_s is not None and self.links is not None
        link = self.links[tier - 1]
        compute_s = self._compute_s(n, start)
        if compute_s <= 0:
            return 0.0
        load_s = link.latency_s + n * self.kv_bytes_per_token / link.bandwidth_bytes_per_s
        return min(max((compute_s - load_s) / compute_s, 0.0), 1.0)

    def load_s(self, tier: int, n: int) -> float:
        """Seconds to load n tokens of KV from `tier` (0 for HBM or without links)."""
        if tier == GPU or self.links is None or n <= 0:
            return 0.0
        link = self.links[tier - 1]
        return link.latency_s + n * self.kv_bytes_per_token / link.bandwidth_bytes_per_s


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
        self._compute_s = ChunkCompute(preset)

    def measure(self, decision: RouteDecision, prompt_tokens: int) -> KvSupply:
        if decision.prefill_endpoint is not None:
            tiers = decision.prefill_cached_tiers or TierTokens(gpu=decision.prefill_cached_tokens_estimate)
        else:
            tiers = decision.cached_tiers or TierTokens(gpu=decision.cached_tokens_estimate)
        if self.credit.mode == GPU_ONLY:
            tiers = TierTokens(gpu=tiers.gpu)
        moved: list[tuple[str, int]] = []
        seconds = self._prefill_s(tiers, moved)
        prefill = decision.prefill_endpoint
        if prefill is not None:
            pulled = max(prompt_tokens - decision.cached_tokens_estimate, 0)
            if pulled:
                link = link_class(prefill.topology, decision.endpoint.topology) or UNKNOWN_LINK
                moved.append((link, pulled * self.kv_bytes_per_token))
        gpu_seconds = seconds * self.preset.tp
        return KvSupply(tiers.total, self.credit.credited(tiers), gpu_seconds, self._usd(gpu_seconds), tuple(moved))

    def measure_engine(self, decision: RouteDecision, cached_tokens: int) -> KvSupply:
        """The saving of a dispatch without a prefill leg, from the cached tokens its engine reported
        (module doc): `real_tokens` is the engine's count, `gpu_seconds` and `usd` its prefill priced
        over the router's tiers; no credit, no bytes (the router's figures carry those)."""
        expected = decision.cached_tiers or TierTokens(gpu=decision.cached_tokens_estimate)
        tiers = expected.engine_split(cached_tokens)
        gpu_seconds = self._prefill_s(tiers, None) * self.preset.tp
        return KvSupply(tiers.total, 0.0, gpu_seconds, self._usd(gpu_seconds))

    def _prefill_s(self, tiers: TierTokens, moved: list[tuple[str, int]] | None) -> float:
        """Seconds of prefill the cached `tiers` spare one GPU (their loads paid); lower-tier bytes to `moved`."""
        seconds = self._compute_s(tiers.gpu, 0) if tiers.gpu > 0 else 0.0
        start = tiers.gpu
        for tier, n in ((CPU, tiers.cpu), (DISK, tiers.disk), (REMOTE, tiers.remote)):
            if n <= 0:
                continue
            compute_s = self._compute_s(n, start)
            seconds += max(compute_s - self.physics.load_s(tier, n), 0.0)
            if moved is not None:
                moved.append((TIER_NAMES[tier], n * self.kv_bytes_per_token))
            start += n
        return seconds

    def _usd(self, gpu_seconds: float) -> float | None:
        return gpu_seconds * self.usd_per_gpu_hour / 3600.0 if self.usd_per_gpu_hour is not None else None

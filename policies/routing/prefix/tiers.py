"""KV-cache tiers: how many of a prompt's cached tokens sit in each tier, and what a hit there is worth.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from backends.perf.capacity import kv_bytes_per_token_per_device
from backends.perf.presets import Preset
from backends.perf.roofline import step_cost

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


GPU_ONLY: Final = "gpu-only"
FLAT: Final = "flat"
CONSTANT: Final = "constant"
PHYSICS: Final = "physics"


@dataclass(frozen=True, slots=True)
class TierLink:
    """How a tier is reached: bandwidth per device (bytes/s) and a fixed latency per load (s)."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0


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
        assert self.preset is not None and self.links is not None
        link = self.links[tier - 1]
        compute_s = step_cost(self.preset, [(n, start)]).compute_s
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

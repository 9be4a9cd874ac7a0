"""The `routing:` section of gateway.yaml (pydantic: config only, validated against the registries).

    routing:
      max_stats_age_s: 2.0            # scraped stats older than this count as saturated
      prefix_index: {mode: approximate, block_size_tokens: 64}
      default:                        # pipeline of every pool without its own entry
        filters: [{type: load-gate, params: {metric: requests, abs_threshold: 8}}]
        scorers:
          - {type: work-cost, weight: 3}
          - {type: prefix-cache, weight: 1}
        picker: {type: near-best-random, params: {tolerance: 0.03}}
      pools:
        llama-pd: {pd: {min_uncached_tokens: 1024}}   # unset keys inherit from `default`
        remote:   {router: least-inflight}

Every component is `{type: <registry name>, weight: <scorers only>, params: {...}}`; unknown types or
params fail at load with the key path and the list of known names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.routing import components


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ComponentSpec(_Strict):
    type: str = Field(description="registry name, kebab-case")
    weight: float = Field(default=1.0, ge=0, description="scorers: multiplier of the [0, 1] score")
    params: dict[str, Any] = Field(
        default_factory=dict, description="the component's own parameters (checked against its registry entry at load)"
    )


def _check(kind: str, specs: list[ComponentSpec]) -> None:
    for spec in specs:
        components.build(kind, spec.type, spec.params)


def _default_filters() -> list[ComponentSpec]:
    return [
        ComponentSpec(type="load-gate", params={"metric": "requests", "abs_threshold": 8, "rel_threshold": 1.5}),
        ComponentSpec(type="context-length"),
    ]


def _default_scorers() -> list[ComponentSpec]:
    return [
        ComponentSpec(type="work-cost", weight=3.0),
        ComponentSpec(type="prefix-cache", weight=1.0),
        ComponentSpec(type="kv-usage", weight=1.0),
        ComponentSpec(type="queue-depth", weight=1.0),
        ComponentSpec(type="session-affinity", weight=2.0),
    ]


def _default_picker() -> ComponentSpec:
    return ComponentSpec(type="near-best-random", params={"tolerance": 0.03})


class PipelineConfig(_Strict):
    """Filters -> weighted scorers -> picker for one pool (or a baseline router instead)."""

    router: Literal["scoring", "least-inflight", "round-robin"] = Field(
        default="scoring",
        description="scoring: filters, scorers and picker; least-inflight and round-robin are baselines",
    )
    filters: list[ComponentSpec] = Field(
        default_factory=_default_filters,
        description="drop endpoints that must not take the request (overloaded, context too short)",
    )
    scorers: list[ComponentSpec] = Field(
        default_factory=_default_scorers, description="each scores endpoints in [0, 1]; the weighted sum ranks them"
    )
    picker: ComponentSpec = Field(default_factory=_default_picker, description="chooses among the ranked endpoints")

    @model_validator(mode="after")
    def _components_exist(self) -> PipelineConfig:
        _check("filter", self.filters)
        _check("scorer", self.scorers)
        _check("picker", [self.picker])
        if self.router == "scoring" and not any(s.weight > 0 for s in self.scorers):
            raise ValueError("a scoring pipeline needs at least one scorer with weight > 0")
        return self


def _default_prefill_pipeline() -> PipelineConfig:
    return PipelineConfig(
        filters=[ComponentSpec(type="load-gate", params={"metric": "tokens", "abs_threshold": 32768})],
        scorers=[
            ComponentSpec(type="work-cost", weight=3.0, params={"decode_weight": 0.0, "request_tokens": 0.0}),
            ComponentSpec(type="prefix-cache", weight=1.0),
            ComponentSpec(type="kv-usage", weight=0.5),
        ],
    )


class ConvertibleConfig(_Strict):
    """Decode replicas that prefill when the prefill replicas are backed up (convertible decoders)."""

    backlog_tokens: int = Field(
        default=8192,
        ge=0,
        description="prefill on the decode endpoint when the chosen prefill endpoint has more pending: "
        "about a prefill replica's velocity x the TTFT objective (docs/autoscaling.md)",
    )
    max_kv_usage: float = Field(default=0.8, ge=0, le=1, description="...if the decode endpoint's KV use is at most")
    max_pending_prefill_tokens: int = Field(
        default=4096, ge=0, description="...and its own pending prefill is at most this (decode keeps its TPOT)"
    )


class LinkConfig(_Strict):
    """One class of link a PD pair's KV crosses (per device: each GPU has its own NIC or NVLink ports)."""

    bandwidth_gbps: float = Field(gt=0, description="GB/s (10^9 bytes/s) per device of KV moved over this link")
    latency_ms: float = Field(default=0.0, ge=0, description="fixed cost of one transfer over this link, ms")


def _link(bandwidth_gbps: float, latency_ms: float) -> Any:
    return Field(
        default_factory=lambda: LinkConfig(bandwidth_gbps=bandwidth_gbps, latency_ms=latency_ms),
        description=f"default {bandwidth_gbps:g} GB/s and {latency_ms:g} ms (docs/routing.md#topology-aware-pairing)",
    )


class LinkClassesConfig(_Strict):
    """Bandwidth and latency per link class (backends/types.py), to be calibrated per deployment.

    Defaults: same node, NVLink 4 of an H100 SXM (900 GB/s both directions together, 450 per
    direction); same rack, one 400 Gb/s NDR InfiniBand / Ethernet NIC per GPU (50 GB/s); across racks
    a spine oversubscribed 4:1 (12.5 GB/s per GPU); across zones 10 Gb/s (1.25 GB/s) and 2 ms.
    """

    same_node: LinkConfig = _link(450.0, 0.0)
    same_rack: LinkConfig = _link(50.0, 0.05)
    cross_rack: LinkConfig = _link(12.5, 0.2)
    cross_zone: LinkConfig = _link(1.25, 2.0)


class PDTopologyConfig(_Strict):
    """Topology-aware pairing: a PD pair's cost includes the KV transfer over the link between them."""

    aware: bool = Field(
        default=True,
        description="pair prefill and decode endpoints by prefill time + KV transfer time over their link; "
        "endpoints without topology labels are paired as if blind",
    )
    decode_slack: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="decode endpoints whose pipeline total is within this of the best may be chosen for a faster link",
    )
    links: LinkClassesConfig = Field(default_factory=LinkClassesConfig, description="link classes")


class PDConfig(_Strict):
    """Disaggregated pools (endpoints with roles prefill/decode): when a separate prefill pays off."""

    enabled: bool = Field(default=True, description="false: decode endpoints prefill everything themselves")
    min_uncached_tokens: int = Field(
        default=512, ge=0, description="disaggregate iff the prompt's uncached tokens on the decode endpoint >= this"
    )
    max_prefill_backlog_tokens: int | None = Field(
        default=None, ge=0, description="prefill locally when the chosen prefill endpoint has more pending"
    )
    convertible: ConvertibleConfig | None = Field(
        default=None, description="decode endpoints with headroom prefill during a prefill backlog"
    )
    prefill: PipelineConfig = Field(default_factory=_default_prefill_pipeline)
    topology: PDTopologyConfig = Field(
        default_factory=PDTopologyConfig, description="pairing by the KV transfer over the endpoints' link"
    )
    warn_after_requests: int = Field(
        default=200, ge=1, description="log a warning when a PD pool served this many with none disaggregated"
    )


class PrefixIndexAdvanced(_Strict):
    """`routing.prefix_index.advanced`: the indexes' internals. Their defaults bound memory and follow
    the engines' own timers; a change is a benchmark's decision (bench/replay), not a deployment's."""

    default_capacity_tokens: int = Field(
        default=500_000, ge=1, description="per-endpoint LRU size when the engine reports no KV size"
    )
    max_capacity_tokens: int = Field(
        default=4_000_000, ge=1, description="cap on any endpoint's LRU (bounds memory whatever engines report)"
    )
    max_prefix_tokens: int = Field(default=131_072, ge=1, description="hash at most this many leading tokens")
    precise_keys: Literal["auto", "tokens"] = Field(
        default="auto",
        description="precise: match engines' own hashes where reproducible (auto) or always re-derived token keys",
    )
    speculative_ttl_s: float = Field(default=2.0, ge=0, description="precise: dispatch entries live this long")
    events_timeout_s: float = Field(
        default=10.0, gt=0, description="precise: no event this long after a dispatch -> approximate"
    )
    resync_s: float = Field(default=30.0, ge=0, description="precise: approximate for this long after a gap")
    max_event_blocks_per_endpoint: int = Field(
        default=4_000_000, ge=1, description="precise: cap on tracked engine blocks per endpoint"
    )


class PrefixIndexConfig(_Strict):
    mode: Literal["approximate", "precise", "off"] = Field(
        default="approximate",
        description="approximate: from what was sent where; precise: from the engines' KV events; off",
    )
    block_size_tokens: int = Field(
        default=64, ge=1, description="approximate index block; a multiple of the engines' block size"
    )
    precise_block_size_tokens: int | None = Field(
        default=None, ge=1, description="engine block size when neither events nor metrics report it (else 16)"
    )
    advanced: PrefixIndexAdvanced = Field(
        default_factory=PrefixIndexAdvanced, description="expert tunables: the indexes' bounds and timers"
    )


class TierLinkConfig(_Strict):
    """How one lower KV tier is reached from a replica's GPU."""

    bandwidth_gbps: float = Field(gt=0, description="GB/s per device (10^9 bytes/s) of loading KV from this tier")
    latency_ms: float = Field(default=0.0, ge=0, description="fixed cost of one load from this tier, ms")


def _cpu_link() -> TierLinkConfig:
    return TierLinkConfig(bandwidth_gbps=25.0, latency_ms=0.0)


def _disk_link() -> TierLinkConfig:
    return TierLinkConfig(bandwidth_gbps=5.0, latency_ms=0.1)


def _remote_link() -> TierLinkConfig:
    return TierLinkConfig(bandwidth_gbps=10.0, latency_ms=1.0)


class KvTiersConfig(_Strict):
    """KV-cache tiers below HBM (host DRAM, local disk, a remote store) and what a hit there is worth.

    Bandwidth defaults are to be calibrated per deployment (docs/routing.md#kv-cache-tiers): host DRAM
    over PCIe Gen5 x16 (64 GB/s per direction on paper, about 25 GB/s of KV in practice), a local NVMe
    SSD about 5 GB/s, a remote store over 100 Gb/s RDMA about 10 GB/s (1.25 GB/s over 10 GbE).
    """

    credit: Literal["physics", "constant", "flat", "gpu-only"] = Field(
        default="physics",
        description="physics: prefill time saved minus load time; constant: `constant_credits`; "
        "flat: every tier like HBM; gpu-only: lower tiers ignored",
    )
    constant_credits: tuple[float, float, float, float] = Field(
        default=(1.0, 0.75, 0.25, 0.25),
        description="credit: constant: weight of a cached token on gpu, cpu, disk, remote",
    )
    cpu: TierLinkConfig = Field(default_factory=_cpu_link, description="host DRAM (medium CPU)")
    disk: TierLinkConfig = Field(default_factory=_disk_link, description="local disk (medium DISK)")
    remote: TierLinkConfig = Field(default_factory=_remote_link, description="a remote store (any other medium)")
    offload_capacity_tokens: int = Field(
        default=0,
        ge=0,
        description="approximate index: tokens each replica keeps below HBM (its CPU offload size); 0: HBM only",
    )

    @field_validator("constant_credits")
    @classmethod
    def _credits_in_range(cls, value: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        if any(not 0.0 <= v <= 1.0 for v in value):
            raise ValueError("constant credits must be in [0, 1]")
        return value


class SessionConfig(_Strict):
    use_user_field: bool = Field(default=True, description="the OpenAI `user` field keys a session too")
    max_sessions: int = Field(default=100_000, ge=1, description="LRU bound of the session -> endpoint table")


class ToolAffinityConfig(_Strict):
    """Tool-boundary affinity's state (`policies/routing/tool_affinity.py`): programs expected back on
    the replica that served their tool-call answer, and the TTL learnt from their gaps. Read by the
    `tool-affinity` scorer; the table is kept whether or not a pipeline uses it (a few entries)."""

    quantile: float = Field(
        default=0.9, gt=0, le=1, description="the TTL is this quantile of a tenant's observed tool-call gaps"
    )
    window: int = Field(default=128, ge=1, le=4096, description="the last this many gaps per tenant")
    min_samples: int = Field(default=5, ge=1, description="gaps a tenant needs before its TTL is learnt")
    min_ttl_s: float = Field(default=1.0, gt=0, description="lower clamp of the learnt TTL")
    max_ttl_s: float = Field(
        default=300.0, gt=0, description="upper clamp of the learnt TTL; returns later than this are not learnt"
    )
    default_ttl_s: float = Field(default=30.0, gt=0, description="TTL of a tenant with too few gaps yet")
    max_programs_per_tenant: int = Field(
        default=10_000, ge=1, description="pending returns kept per tenant (least recently noted forgotten)"
    )
    max_tenants: int = Field(default=1_000, ge=1, description="tenants with pending returns or learnt gaps kept")

    @model_validator(mode="after")
    def _ordered(self) -> ToolAffinityConfig:
        if not self.min_ttl_s <= self.default_ttl_s <= self.max_ttl_s:
            raise ValueError("need min_ttl_s <= default_ttl_s <= max_ttl_s")
        return self


class PoolRoutingConfig(PipelineConfig):
    """A pool's own pipeline; `pd` overrides the global PD settings for that pool."""

    pd: PDConfig | None = Field(default=None, description="this pool's PD settings instead of routing.pd")
    kv_tiers: KvTiersConfig | None = Field(
        default=None, description="this pool's KV tier links and credit instead of routing.kv_tiers"
    )


class RoutingConfig(_Strict):
    max_stats_age_s: float = Field(
        default=2.0, gt=0, description="scraped engine stats older than this count as saturated"
    )
    prefix_index: PrefixIndexConfig = Field(
        default_factory=PrefixIndexConfig, description="which endpoints hold a prompt's prefix in their KV cache"
    )
    session: SessionConfig = Field(
        default_factory=SessionConfig, description="session affinity: a session's requests return to its endpoint"
    )
    pd: PDConfig = Field(default_factory=PDConfig, description="prefill/decode disaggregation of pools with both roles")
    kv_tiers: KvTiersConfig = Field(
        default_factory=KvTiersConfig, description="KV-cache tiers below HBM and the credit of a hit there"
    )
    tool_affinity: ToolAffinityConfig = Field(
        default_factory=ToolAffinityConfig,
        description="programs back from a tool call: the TTL learnt from their gaps (the `tool-affinity` scorer)",
    )
    default: PipelineConfig = Field(
        default_factory=PipelineConfig, description="the pipeline of every pool without an entry in pools"
    )
    pools: dict[str, PoolRoutingConfig] = Field(
        default_factory=dict, description="per pool: its own pipeline; keys it leaves out come from default"
    )
    seed: int | None = Field(default=None, description="seed of the pickers' random choices (tests, benchmarks)")

    @field_validator("pools", mode="before")
    @classmethod
    def _inherit_default(cls, value: Any, info: Any) -> Any:
        """Keys a pool leaves out come from `default`, not from the built-in defaults."""
        if not isinstance(value, dict):
            return value
        default = info.data.get("default")
        if default is None:
            return value
        base = default.model_dump()
        merged: dict[str, Any] = {}
        for name, override in value.items():
            if isinstance(override, dict):
                merged[name] = {**base, **override}
            else:
                merged[name] = override
        return merged

    def pipeline_for(self, pool: str) -> PipelineConfig:
        return self.pools.get(pool, self.default)

    def pd_for(self, pool: str) -> PDConfig:
        own = self.pools.get(pool)
        return own.pd if own is not None and own.pd is not None else self.pd

    def kv_tiers_for(self, pool: str) -> KvTiersConfig:
        own = self.pools.get(pool)
        return own.kv_tiers if own is not None and own.kv_tiers is not None else self.kv_tiers

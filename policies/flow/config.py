"""gateway.yaml's `flow_control` section: when a pool counts as saturated, and how much may wait.

```yaml
flow_control:
  enabled: true                  # false: saturation holds nothing (the gate's other checks still may)
  saturation:                    # every pool, unless its own entry below overrides a field
    max_engine_waiting: 5        # requests waiting inside one engine
    max_kv_usage_ratio: 0.8
    max_inflight: null           # the gateway's own in-flight requests per endpoint
    max_predicted_ttft_ms: null  # the pool's TTFT threshold
    reserve_slots: 0             # free batch slots kept for tenants under their share (0: none)
    reserve_max_slots: null      # above reserve_slots: sized from their recent peak demand, up to this
    reserve_margin: 1            # with reserve_max_slots: slots kept beyond that peak
    reserve_avoid_prefills: true # with a reserve: those it is kept for go where no prefill is pending
    preempt: false               # a request finding the pool full may cut a stream of a tenant over its share
    reserve_clear_lane: false    # with a reserve: those over their share start only where no prefill is
                                 # pending, and only while another endpoint with a free slot has none either
    program_reserve_slots: 0     # per endpoint, inside a tenant with program fairness: a program over its
                                 # share may not take the last N free slots while another program is light
  max_queued: 1024               # per pool, requests waiting in the gateway
  max_queued_bytes: 67108864     # per pool, their request bodies
  reserve_active_s: 60           # a tenant keeps its claim on the reserve (and its peak) this long
  program_active_s: 10           # a program keeps its claim on the program reserve this long
  pools:
    llama: {saturation: {max_engine_waiting: 0}, max_queued: 256}
```

Tenant weights and per-band waiting limits are policy (policies.yaml `flow_control`), hot-reloaded;
this section describes the machines.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from policies.flow.saturation import SaturationLimits


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SaturationConfig(_Strict):
    max_engine_waiting: int | None = Field(default=5, ge=0, description="waiting requests in one engine")
    max_kv_usage_ratio: float | None = Field(default=0.8, gt=0, le=1, description="KV-cache usage of one engine")
    max_inflight: int | None = Field(default=None, ge=1, description="gateway's own in-flight requests per endpoint")
    max_predicted_ttft_ms: float | None = Field(default=None, gt=0, description="the pool's TTFT threshold")
    max_stats_age_s: float = Field(default=2.0, gt=0, description="older engine metrics are not read")
    reserve_slots: int = Field(
        default=0, ge=0, description="free batch slots kept for tenants under their share (needs max_num_seqs)"
    )
    reserve_max_slots: int | None = Field(
        default=None,
        ge=0,
        description="above reserve_slots: the reserve follows those tenants' recent peak demand, up to this",
    )
    reserve_margin: int = Field(
        default=1, ge=0, description="slots kept beyond that recent peak (with reserve_max_slots)"
    )
    reserve_avoid_prefills: bool = Field(
        default=True,
        description="with a reserve: a request it is kept for goes where no prefill is pending, if open",
    )
    preempt: bool = Field(
        default=False,
        description=(
            "a request that finds the pool full cuts a plain stream of a tenant over its share, which waits"
            " its turn and continues where it stopped (policies/flow/preempt.py)"
        ),
    )

    reserve_clear_lane: bool = Field(
        default=False,
        description=(
            "with a reserve: a request over its share (or over its weighted share of the band's recent tokens"
            " beside a tenant under it) starts only on an endpoint with no prefill pending, and only while"
            " another endpoint with a free slot has none pending either (policies/flow/reserve.py)"
        ),
    )
    program_reserve_slots: int = Field(
        default=0,
        ge=0,
        description=(
            "per endpoint, inside a tenant with program fairness: a program over its share of the tenant's"
            " requests in flight may not take an endpoint's last N free batch slots while another of the"
            " tenant's programs is active and has nothing waiting (needs max_num_seqs;"
            " policies/flow/program_reserve.py)"
        ),
    )


class PoolFlowConfig(_Strict):
    saturation: SaturationConfig | None = Field(default=None, description="fields set here override the defaults")
    max_queued: int | None = Field(default=None, ge=1, description="this pool's max_queued")
    max_queued_bytes: int | None = Field(default=None, ge=1024, description="this pool's max_queued_bytes")


class FlowAdvanced(_Strict):
    """`flow_control.advanced`: the waiting rooms' timers. They trade CPU and Redis calls for how soon a
    freed slot is seen; a change is a benchmark's decision (bench/fairness), not a deployment's."""

    recheck_ms: float = Field(default=50.0, gt=0, description="the head of a waiting room rechecks this often")
    counters_refresh_ms: float = Field(
        default=100.0, gt=0, description="Redis counters: re-read this often while requests wait"
    )
    counters_flush_ms: float = Field(
        default=5.0, gt=0, description="Redis counters: changes gather this long, then go out in one call per band"
    )


class FlowSettings(_Strict):
    enabled: bool = Field(default=True, description="hold requests while their pool is saturated")
    saturation: SaturationConfig = Field(
        default_factory=SaturationConfig,
        description="when an endpoint can start no more (every pool, unless its own entry overrides a field)",
    )
    max_queued: int = Field(default=1024, ge=1, description="requests waiting per pool")
    max_queued_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description="their bodies, per pool")
    share_window_s: float = Field(default=60.0, gt=0, description="window of tokenway_fair_share_ratio")
    reserve_active_s: float = Field(
        default=60.0,
        gt=0,
        description="a tenant keeps its claim on the slot reserve this long after its last request (and its peak)",
    )
    program_active_s: float = Field(
        default=10.0,
        gt=0,
        description="a program keeps its claim on the program slot reserve this long after its last request",
    )
    pools: dict[str, PoolFlowConfig] = Field(
        default_factory=dict, description="per pool: overrides of saturation and the room sizes"
    )
    advanced: FlowAdvanced = Field(
        default_factory=FlowAdvanced, description="expert tunables: how often waiting rooms and counters look again"
    )

    def limits(self, pool: str, max_num_seqs: int | None = None) -> SaturationLimits:
        """The pool's saturation limits: its own fields over the defaults; all off when disabled."""
        if not self.enabled:
            return SaturationLimits(
                None, None, None, None, self.saturation.max_stats_age_s, 0, max_num_seqs, None, 1, False
            )
        merged = self.saturation.model_dump()
        override = self.pools.get(pool)
        if override is not None and override.saturation is not None:
            merged.update({k: getattr(override.saturation, k) for k in override.saturation.model_fields_set})
        return SaturationLimits(**merged, max_num_seqs=max_num_seqs)

    def program_reserve_on(self) -> bool:
        """Whether any pool keeps a program slot reserve (only then are program counts shared)."""
        if not self.enabled:
            return False
        pools = (o.saturation for o in self.pools.values() if o.saturation is not None)
        return self.saturation.program_reserve_slots > 0 or any(
            "program_reserve_slots" in s.model_fields_set and s.program_reserve_slots > 0 for s in pools
        )

    def room(self, pool: str) -> tuple[int, int]:
        """(max_queued, max_queued_bytes) of the pool's waiting room."""
        override = self.pools.get(pool)
        count = override.max_queued if override is not None and override.max_queued is not None else self.max_queued
        size = self.max_queued_bytes
        if override is not None and override.max_queued_bytes is not None:
            size = override.max_queued_bytes
        return count, size

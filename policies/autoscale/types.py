"""The planner's vocabulary: what it is told about each pool, what it remembers, what it decides.

Everything is a frozen value so a planning pass is a pure function of its inputs: recorded inputs
replay to the same decisions (tests/policies/autoscale/). The replicas' states (`RoleState`) are the
executor's report and live beside it in `backends.autoscale.executor`; a `PoolPlan` is what the
executor carries out (it reads the plan through its own `PoolTarget` protocol).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.autoscale.executor import RoleState
from policies.autoscale.forecast import Floor, Forecast

NEVER = float("-inf")


@dataclass(frozen=True, slots=True)
class RoleSignals:
    """One role of a pool: its replicas, each one's token velocity at the SLO, and its load."""

    role: str  # both | prefill | decode
    replicas: RoleState
    prefill_velocity: float  # uncached prompt tokens/s one replica sustains within the SLO (0 = none)
    decode_velocity: float  # output tokens/s one replica sustains within the SLO (0 = none)
    kv_usage: float = 0.0  # mean KV cache share in use over its ready replicas
    engine_waiting: int = 0  # requests waiting inside its engines
    engine_running: int = 0  # requests running inside its engines


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """What the planner knows of one pool at `now_s` (monotonic seconds)."""

    pool: str
    now_s: float
    prefill: Forecast  # arriving uncached prompt tokens/s
    decode: Forecast  # arriving output tokens/s (expected)
    roles: tuple[RoleSignals, ...]
    queued_requests: int = 0  # waiting in the gateway (flow queue and cold-start hold)
    queued_tokens: float = 0.0  # their prompt tokens, plus those dispatched and not yet prefilled
    held: int = 0  # of those, held for a replica to start or wake
    inflight: int = 0  # requests running on the pool's replicas
    last_request_s: float = NEVER  # the last arrival
    startup_s: float = 30.0  # learnt start-up time of one replica
    wake_s: float = 0.0  # learnt wake-up time (pools that sleep)
    devices_per_replica: int = 1
    device_group: str = ""  # the budget the replicas' devices come from ("" = unmanaged)
    awake_since_s: float = NEVER  # when its newest replica became active (shared devices)
    floors: tuple[Floor, ...] = ()  # scheduled capacity near now (policies/autoscale/forecast.py)
    adapter_loads_per_min: float = 0.0  # LoRA adapters loaded on demand per minute per ready replica, lately

    def role(self, name: str) -> RoleSignals | None:
        return next((r for r in self.roles if r.role == name), None)


@dataclass(frozen=True, slots=True)
class PlannerMemory:
    """What one pool's planner carries from a pass to the next."""

    last_up_s: float = NEVER
    last_down_s: float = NEVER
    # (time, per-role need at the scale-down threshold) of the stabilisation window, oldest first
    history: tuple[tuple[float, tuple[tuple[str, int], ...]], ...] = ()
    # per role, the count the last pass wanted: a want the budget has not granted yet is one scale-up,
    # not a new one every pass (which would hold the other roles' scale-down cooldown for ever)
    wanted: tuple[tuple[str, int], ...] = ()
    # the scheduled floors in force at the last pass: they stay in force until they end, whatever
    # the lead learnt since (policies/autoscale/forecast.py)
    floors: tuple[Floor, ...] = ()


@dataclass(frozen=True, slots=True)
class RolePlan:
    role: str
    current: int  # active replicas (ready + starting)
    need: float  # replicas the load needs at the target utilisation (before rounding and bounds)
    wanted: int  # after hysteresis, cooldowns, stabilisation and bounds
    desired: int  # after the device budget
    # sleeping replicas to keep (a pool with `sleep` and `warm_reserve`): the planner sets the pool's
    # warm_reserve, `reserve_target` fits it under max_replicas once the budget has spoken; the executor
    # starts and puts to sleep up to this many beyond `desired`, and stops those past it; None: every
    # replica scaled down sleeps and stays asleep (no bound, none started ahead)
    reserve: int | None = None


@dataclass(frozen=True, slots=True)
class PoolPlan:
    pool: str
    roles: tuple[RolePlan, ...]
    reason: str
    memory: PlannerMemory = field(default_factory=PlannerMemory)

    def role(self, name: str) -> RolePlan | None:
        return next((r for r in self.roles if r.role == name), None)

    @property
    def desired(self) -> int:
        return sum(r.desired for r in self.roles)

    @property
    def current(self) -> int:
        return sum(r.current for r in self.roles)

    @property
    def wanted(self) -> int:
        return sum(r.wanted for r in self.roles)

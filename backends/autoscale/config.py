"""`autoscale:` and `share:` of a pool in gateway.yaml (pydantic: configuration only).

    pools:
      - name: llama-8b
        model: llama-3.1-8b
        engine: vllm
        autoscale: {min_replicas: 0, max_replicas: 4, idle_s: 300, max_held: 64, max_hold_s: 120}

An autoscaled pool launches `replicas` (clamped into [min_replicas, max_replicas]) at start and
keeps `max_replicas` slots (ids, ports) planned, so a replica started later keeps the id and port a
restart would give it. Devices come from the host's budget when a replica starts (`devices: auto`,
or the pool's own list), not at plan time.

The planner that reads it lives in `policies/autoscale/`; the model stays here because a pool's
configuration (`backends.config.PoolConfig`) holds it and the executor reads it, and `backends`
imports no room above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DAYS: Final = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


@dataclass(frozen=True, slots=True)
class Window:
    """One `autoscale.schedule` entry as the planner's floors read it (`policies.autoscale.forecast`):
    resolved from the validated config, so the planner never parses text."""

    start_min: int  # minutes after UTC midnight
    end_min: int  # the window wraps midnight when end_min <= start_min
    min_replicas: Mapping[str, int]  # role -> floor; "" = every role
    days: frozenset[int] = frozenset()  # weekday of the window's start (0 = monday); empty = every day

    @property
    def label(self) -> str:
        return f"schedule {_hhmm(self.start_min)}-{_hhmm(self.end_min)}"

    @property
    def length_s(self) -> float:
        minutes = (self.end_min - self.start_min) % (24 * 60)
        return float(minutes or 24 * 60) * 60.0


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def parse_hhmm(text: str) -> int:
    """Minutes after midnight of "HH:MM" (00:00-23:59; "24:00" is the next day's midnight)."""
    hours, sep, minutes = text.partition(":")
    if not sep or not hours.isdigit() or not minutes.isdigit() or len(minutes) != 2:
        raise ValueError(f"{text!r} is not HH:MM")
    value = int(hours) * 60 + int(minutes)
    if int(minutes) > 59 or value > 24 * 60:
        raise ValueError(f"{text!r} is not a time of day")
    return value % (24 * 60)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SleepConfig(_Strict):
    """Scale down by putting replicas to sleep instead of stopping them (vLLM's sleep mode).

    Level 1 offloads the weights to host memory (a wake copies them back over PCIe: seconds); level 2
    discards them (a wake reloads them from storage, without the engine's initialisation)."""

    level: Literal[1, 2] = Field(
        default=1, description="1: weights offloaded to host memory (wakes in seconds); 2: weights discarded"
    )


class RoleBounds(_Strict):
    min_replicas: int = Field(default=0, ge=0, description="replicas of this role kept however idle the pool is")
    max_replicas: int = Field(default=1, ge=0, description="launched slots of this role planned (ids, ports)")

    @model_validator(mode="after")
    def _order(self) -> RoleBounds:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas is larger than max_replicas")
        return self


class ScheduleWindow(_Strict):
    """A daily window of scheduled capacity (UTC): at least `min_replicas` from `start` to `end`,
    kept a start-up early so the replicas serve when it opens (policies/autoscale/forecast.py)."""

    start: str = Field(description='"HH:MM" UTC')
    end: str = Field(description='"HH:MM" UTC; before start: the window wraps midnight; equal: all day')
    min_replicas: int | dict[Literal["prefill", "decode"], int] = Field(
        description="the floor, or per role of a prefill/decode pool"
    )
    days: list[Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]] | None = Field(
        default=None, description="days the window starts on (default: every day)"
    )

    @field_validator("start", "end")
    @classmethod
    def _time(cls, value: str) -> str:
        parse_hhmm(value)
        return value

    @field_validator("min_replicas")
    @classmethod
    def _count(cls, value: int | dict[str, int]) -> int | dict[str, int]:
        counts = value.values() if isinstance(value, dict) else (value,)
        if any(c < 0 for c in counts):
            raise ValueError("min_replicas must be >= 0")
        return value

    def window(self) -> Window:
        found = self.min_replicas
        counts: dict[str, int] = {str(k): v for k, v in found.items()} if isinstance(found, dict) else {"": found}
        days = frozenset(DAYS.index(d) for d in self.days or ())
        return Window(parse_hhmm(self.start), parse_hhmm(self.end), counts, days)


class AutoscaleConfig(_Strict):
    """How the planner sizes one pool (docs/autoscaling.md explains each signal)."""

    min_replicas: int = Field(
        default=0, ge=0, description="replicas kept however idle the pool is (0: an idle pool stops them all)"
    )
    max_replicas: int = Field(default=1, ge=0, description="launched slots planned (ids, ports)")
    roles: dict[Literal["prefill", "decode"], RoleBounds] | None = Field(
        default=None, description="per-role bounds of a prefill/decode pool (instead of min/max_replicas)"
    )
    interval_s: float = Field(default=5.0, gt=0, description="a planning pass every interval")
    idle_s: float = Field(default=300.0, ge=0, description="no request for this long: down to min_replicas")
    max_held: int = Field(default=64, ge=0, description="requests held while a replica starts or wakes")
    max_hold_s: float = Field(default=120.0, ge=0, description="longest a request is held for a start")
    target_utilization: float = Field(
        default=0.8, gt=0, le=1, description="share of a replica's token velocity at the SLO to plan for"
    )
    hysteresis: float = Field(
        default=0.15, ge=0, lt=1, description="scale down only when utilisation is this far below target"
    )
    kv_target: float = Field(default=0.85, gt=0, le=1, description="KV cache share in use to plan for")
    scale_up_cooldown_s: float = Field(default=0.0, ge=0, description="least time between two scale-ups")
    scale_down_cooldown_s: float = Field(
        default=60.0, ge=0, description="least time after any scale event before a scale-down"
    )
    stabilization_s: float = Field(
        default=60.0, ge=0, description="a scale-down goes only to the largest need of this window"
    )
    scale_down_step: int = Field(
        default=1,
        ge=1,
        description="most replicas a role gives up in one scale-down (a trend that turns back finds the rest running)",
    )
    priority: int = Field(default=0, description="larger first when pools share the device budget")
    surge_replicas: int = Field(
        default=0,
        ge=0,
        description="replicas beyond max_replicas while the device budget has devices no other pool wants",
    )
    sleep: SleepConfig | None = Field(default=None, description="sleep instead of stopping (vLLM sleep mode)")
    warm_reserve: int | None = Field(
        default=None,
        ge=0,
        description="replicas kept warm beyond the need: asleep in a pool that sleeps (the rest stop), else awake"
        " (the tokens planner only)",
    )
    ttft_slo_ms: float = Field(default=2000.0, gt=0, description="the TTFT a replica's prefill velocity keeps")
    tpot_slo_ms: float = Field(default=100.0, gt=0, description="the TPOT a replica's decode velocity keeps")
    startup_s: float | None = Field(
        default=None, gt=0, description="start-up time before one is measured (default: an estimate)"
    )
    convert_roles: bool = Field(
        default=True, description="PD pools: move devices between roles when one role's need lasts"
    )
    planner: Literal["tokens", "hpa"] = Field(
        default="tokens",
        description="tokens: token velocity (the default); hpa: a Kubernetes-HPA-shaped baseline on requests running",
    )
    hpa_target_running: float = Field(
        default=32.0, gt=0, description="hpa planner: requests running (and waiting) per replica to aim for"
    )
    schedule: list[ScheduleWindow] = Field(
        default_factory=list, max_length=64, description="daily windows of scheduled capacity (UTC)"
    )
    forecast_alpha: float = Field(default=0.5, gt=0, le=1, description="EWMA weight of the newest rate")
    forecast_beta: float = Field(default=0.3, ge=0, le=1, description="EWMA weight of the newest trend")
    adapter_loads_per_min: float = Field(
        default=30.0,
        ge=0,
        description="LoRA adapter loads on demand per minute per ready replica above which the pool thrashes "
        "loading adapters: one more replica (within max_replicas), and no scale-down that would push the rate "
        "above it (0: off)",
    )
    forecast_step_z: float = Field(
        default=3.0,
        ge=0,
        description="a window's arrivals this many Poisson deviations above the forecast count are a step: "
        "the token rates' level takes that window's rates at once when the replicas serving cannot absorb them "
        "(0: always smoothed)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.roles is None:
            if self.min_replicas > self.max_replicas:
                raise ValueError("min_replicas is larger than max_replicas")
            if self.max_replicas < 1:
                raise ValueError("max_replicas must be at least 1")
        elif not any(b.max_replicas for b in self.roles.values()):
            raise ValueError("roles: some role needs max_replicas >= 1")
        for entry in self.schedule:
            if isinstance(entry.min_replicas, dict) and self.roles is None:
                raise ValueError("schedule: min_replicas per role needs roles")
        if self.planner == "hpa" and self.warm_reserve:
            # the baseline is the Kubernetes HPA's algorithm, which has no reserve: a key it would
            # silently ignore is refused instead
            raise ValueError("warm_reserve needs planner: tokens (the hpa baseline keeps no reserve)")
        return self

    def windows(self) -> tuple[Window, ...]:
        """`schedule` as the floor function reads it."""
        return tuple(entry.window() for entry in self.schedule)

    def bounds(self, role: str) -> tuple[int, int]:
        """(min, max) replicas of `role` ("both" for an ordinary pool)."""
        if self.roles is None:
            return (self.min_replicas, self.max_replicas) if role == "both" else (0, 0)
        found = self.roles.get(role)  # type: ignore[call-overload]
        return (found.min_replicas, found.max_replicas) if found is not None else (0, 0)

    def ceiling(self, role: str) -> int:
        """The most replicas of `role` the planner may want: `max_replicas` plus `surge_replicas` (the
        budget grants the surge only from devices no other pool's planner wants)."""
        high = self.bounds(role)[1]
        return high + self.surge_replicas if high else 0


class ShareConfig(_Strict):
    """Pools that list the same `devices` and `share:` take turns on them: at most `max_awake` of
    those pools' replicas are awake per device; a request for a sleeping one wakes it and sleeps the
    least recently used awake one once its requests have drained."""

    max_awake: int = Field(default=1, ge=1, description="replicas of the sharing pools awake per device at once")
    min_awake_s: float = Field(
        default=2.0, ge=0, description="a woken replica keeps its place this long while it has traffic"
    )

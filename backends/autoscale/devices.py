"""The device budget of autoscaled pools: which devices each pool may use, and which are free now.

Groups: a pool with `devices: auto` takes from the host's devices that no fixed-size pool holds and
no autoscaled pool lists ("auto"); a pool that lists devices uses those ("devices:0,1"), and pools
that list the same devices with `share:` take turns on them (`max_awake` replicas awake per device).
A pool without `devices` is not managed: its replicas take none.

Occupancy is read from the endpoints each time, not tracked apart: a replica with a live, awake
process (starting, ready, draining, unhealthy) holds one slot of each device it was given; a
sleeping one keeps its devices (it can only wake there) but holds no slot; a stopped one holds
nothing. Starts and wakes in progress reserve their devices until their endpoint shows them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from backends.config import PoolConfig
from backends.types import Endpoint, EndpointState

AUTO = "auto"
AWAKE_STATES = frozenset({EndpointState.STARTING, EndpointState.READY, EndpointState.DRAINING, EndpointState.UNHEALTHY})


def group_of(pool: PoolConfig) -> str:
    """The budget group of a pool's replicas ("" = unmanaged)."""
    if pool.devices is None:
        return ""
    if pool.devices == "auto":
        return AUTO
    return "devices:" + ",".join(str(d) for d in sorted(pool.devices))


@dataclass(slots=True)
class DeviceBudget:
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)  # device -> awake replicas it takes
    per_replica: dict[str, int] = field(default_factory=dict)  # pool -> devices one replica needs

    @classmethod
    def build(
        cls, pools: Sequence[PoolConfig], inventory: tuple[int, ...] | None, held_by_fixed: Iterable[int] = ()
    ) -> DeviceBudget:
        budget = cls()
        listed: set[int] = set()
        for pool in pools:
            if not pool.elastic:
                continue
            budget.per_replica[pool.name] = pool.tensor_parallel * pool.pipeline_parallel
            group = group_of(pool)
            if isinstance(pool.devices, list):
                devices = tuple(sorted(pool.devices))
                budget.groups[group] = devices
                listed.update(devices)
                awake = pool.share.max_awake if pool.share is not None else 1
                for device in devices:
                    budget.slots[device] = max(budget.slots.get(device, 1), awake)
        if any(group_of(p) == AUTO for p in pools if p.elastic):
            fixed = set(held_by_fixed)
            free = tuple(d for d in (inventory or ()) if d not in fixed and d not in listed)
            budget.groups[AUTO] = free
            for device in free:
                budget.slots.setdefault(device, 1)
        return budget

    def capacity(self) -> dict[str, int]:
        """Device slots per group (what the planner's budget shares)."""
        return {group: sum(self.slots.get(d, 1) for d in devices) for group, devices in self.groups.items()}

    def used(self, endpoints: Iterable[Endpoint], reserved: Mapping[str, tuple[int, ...]]) -> dict[int, int]:
        """Slots taken per device by awake replicas and by starts/wakes in progress."""
        taken: dict[int, int] = {}
        for endpoint in endpoints:
            devices = reserved.get(endpoint.id)
            if devices is None and endpoint.state in AWAKE_STATES:
                devices = endpoint.devices
            for device in devices or ():
                taken[device] = taken.get(device, 0) + 1
        return taken

    def place(
        self, pool: PoolConfig, endpoints: Iterable[Endpoint], reserved: Mapping[str, tuple[int, ...]]
    ) -> tuple[int, ...] | None:
        """Devices for a new replica of `pool` (lowest free first); () when unmanaged; None when full."""
        group = group_of(pool)
        if not group:
            return ()
        taken = self.used(endpoints, reserved)
        free = [d for d in self.groups.get(group, ()) if taken.get(d, 0) < self.slots.get(d, 1)]
        need = self.per_replica.get(pool.name, 1)
        return tuple(free[:need]) if len(free) >= need else None

    def can_wake(
        self, endpoint: Endpoint, endpoints: Iterable[Endpoint], reserved: Mapping[str, tuple[int, ...]]
    ) -> bool:
        """Whether every device a sleeping replica holds has a free slot."""
        taken = self.used(endpoints, reserved)
        return all(taken.get(d, 0) < self.slots.get(d, 1) for d in endpoint.devices)

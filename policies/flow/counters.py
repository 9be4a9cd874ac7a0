"""Where the virtual counters live: the contract, and the in-memory store of one gateway process.

Every method is synchronous and O(1): ordering reads counters at every dispatch, so a read never
waits on a network. A shared store (`redis_counters.py`) keeps a local view that it updates at once
and reconciles with Redis in the background; `age_s` says how old the shared part of that view is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from policies.flow import vtc


class Counters(Protocol):
    def value(self, pool: str, band: int, tenant: str) -> float: ...

    def last_served(self, pool: str, band: int) -> float:
        """The counter of the tenant dispatched last in (pool, band): a returning tenant's floor when
        nobody waits."""
        ...

    def lift(self, pool: str, band: int, tenant: str, floor: float) -> None:
        """Raise the tenant's counter to `floor` if below (a tenant returning after idling)."""
        ...

    def charge(
        self,
        pool: str,
        band: int,
        tenant: str,
        delta: float,
        *,
        dispatch: bool,
        credit: float = 0.0,
        floor: float | None = None,
    ) -> None:
        """Add `delta` (a dispatch's cost ÷ weight, or an end-of-request correction). A dispatch first
        lifts the counter to `floor` (when given), then takes off `credit` (refunds held back since
        the tenant's last dispatch, ≤ 0; never below `floor`), and that value becomes the band's last
        served counter before the delta is added."""
        ...

    def watch(self, pool: str, band: int, waiting: bool) -> None:
        """Requests wait (or stopped waiting) in (pool, band): a shared store keeps its view fresh."""
        ...

    def age_s(self, pool: str, band: int) -> float:
        """How old the shared part of the local view is (0 for a store of one process)."""
        ...

    def status(self) -> dict[str, object]: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class _Band:
    values: dict[str, float] = field(default_factory=dict)
    last_served: float = 0.0


class MemoryCounters:
    """Counters of one process. Keys are (pool, band, tenant): pools and tenants are configured, so
    the table is bounded by configuration, not by traffic."""

    source = "memory"

    def __init__(self) -> None:
        self._bands: dict[tuple[str, int], _Band] = {}

    def _band(self, pool: str, band: int) -> _Band:
        found = self._bands.get((pool, band))
        if found is None:
            found = self._bands[(pool, band)] = _Band()
        return found

    def value(self, pool: str, band: int, tenant: str) -> float:
        found = self._bands.get((pool, band))
        return found.values.get(tenant, 0.0) if found is not None else 0.0

    def last_served(self, pool: str, band: int) -> float:
        found = self._bands.get((pool, band))
        return found.last_served if found is not None else 0.0

    def lift(self, pool: str, band: int, tenant: str, floor: float) -> None:
        values = self._band(pool, band).values
        if values.get(tenant, 0.0) < floor:
            values[tenant] = floor

    def charge(
        self,
        pool: str,
        band: int,
        tenant: str,
        delta: float,
        *,
        dispatch: bool,
        credit: float = 0.0,
        floor: float | None = None,
    ) -> None:
        state = self._band(pool, band)
        value = vtc.credited(state.values.get(tenant, 0.0), credit, floor)
        if dispatch:
            state.last_served = value
        state.values[tenant] = value + delta

    def watch(self, pool: str, band: int, waiting: bool) -> None:
        return None

    def age_s(self, pool: str, band: int) -> float:
        return 0.0

    def snapshot(self) -> dict[str, dict[int, dict[str, float]]]:
        out: dict[str, dict[int, dict[str, float]]] = {}
        for (pool, band), state in self._bands.items():
            out.setdefault(pool, {})[band] = dict(state.values)
        return out

    def status(self) -> dict[str, object]:
        return {"store": self.source}

    async def close(self) -> None:
        return None

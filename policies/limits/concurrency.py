"""Concurrency leases that expire on their own.

A lease is (ticket id -> expiry). Counting only unexpired leases means a gateway that crashes between
admit and settle leaks nothing for longer than the lease TTL; the Redis store keeps the same shape in a
sorted set scored by expiry.
"""

from __future__ import annotations


class LeaseTable:
    """Leases per key, in memory. O(active leases of one key) per acquire, which capacity bounds."""

    def __init__(self) -> None:
        self._leases: dict[str, dict[str, float]] = {}

    def active(self, key: str, now_s: float) -> int:
        """Unexpired leases of `key` (expired ones are dropped as a side effect)."""
        leases = self._leases.get(key)
        if not leases:
            return 0
        expired = [lease for lease, expires_at_s in leases.items() if expires_at_s <= now_s]
        for lease in expired:
            del leases[lease]
        return len(leases)

    def acquire(self, key: str, lease_id: str, expires_at_s: float) -> None:
        self._leases.setdefault(key, {})[lease_id] = expires_at_s

    def release(self, key: str, lease_id: str) -> None:
        leases = self._leases.get(key)
        if leases is not None:
            leases.pop(lease_id, None)
            if not leases:
                del self._leases[key]

    def sweep(self, now_s: float) -> None:
        for key in list(self._leases):
            if self.active(key, now_s) == 0:
                self._leases.pop(key, None)

    def items(self, now_s: float) -> list[tuple[str, int]]:
        return [(key, self.active(key, now_s)) for key in list(self._leases)]

    def clear(self) -> None:
        self._leases.clear()

"""The other replicas' load, folded into each endpoint's `InFlight`.

Each replica's latest report replaces its previous one; a replica not heard from for `ttl_s`
(killed, partitioned from Redis) is dropped, and with it everything it reported: its requests
age out instead of staying on the books forever. Only endpoints this replica also knows, at the
same URL, are folded (ids are the same on every replica for static and discovered endpoints;
launched replicas are each gateway's own and are never shared).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from backends.types import Endpoint
from gateway.replicas.wire import Load


@dataclass(slots=True)
class Peer:
    seen_s: float
    sequence: int = -1
    loads: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    batches: int = 0
    gaps: int = 0  # batches it sent that this replica never read (trimmed or lost)


class RemoteLoads:
    def __init__(self, ttl_s: float, lookup: Callable[[str], Endpoint | None], max_peers: int = 1024) -> None:
        self.ttl_s = ttl_s
        self.lookup = lookup
        self.max_peers = max_peers
        self.peers: dict[str, Peer] = {}
        self.expired = 0

    def heard(self, replica: str, sequence: int, now_s: float) -> Peer:
        peer = self.peers.get(replica)
        if peer is None:
            if len(self.peers) >= self.max_peers:  # bounded: the stalest peer goes first
                self._drop(min(self.peers, key=lambda r: self.peers[r].seen_s))
            peer = self.peers[replica] = Peer(now_s)
        elif peer.sequence >= 0 and sequence > peer.sequence + 1:
            peer.gaps += sequence - peer.sequence - 1
        peer.seen_s = now_s
        peer.sequence = max(peer.sequence, sequence)
        peer.batches += 1
        return peer

    def report(self, replica: str, loads: Iterable[Load]) -> None:
        """Replace `replica`'s load report (it must have been `heard` first)."""
        peer = self.peers[replica]
        old = peer.loads
        peer.loads = {endpoint_id: (r, p, d) for endpoint_id, r, p, d in loads if r or p or d}
        self._refold(old.keys() | peer.loads.keys())

    def expire(self, now_s: float) -> list[str]:
        gone = [r for r, peer in self.peers.items() if now_s - peer.seen_s > self.ttl_s]
        for replica in gone:
            self._drop(replica)
        self.expired += len(gone)
        return gone

    def totals(self, endpoint_id: str) -> tuple[int, int, int]:
        r = p = d = 0
        for peer in self.peers.values():
            load = peer.loads.get(endpoint_id)
            if load is not None:
                r, p, d = r + load[0], p + load[1], d + load[2]
        return r, p, d

    def _drop(self, replica: str) -> None:
        peer = self.peers.pop(replica, None)
        if peer is not None:
            self._refold(peer.loads.keys())

    def _refold(self, endpoint_ids: Iterable[str]) -> None:
        for endpoint_id in endpoint_ids:
            endpoint = self.lookup(endpoint_id)
            if endpoint is not None:
                endpoint.inflight.set_remote(*self.totals(endpoint_id))

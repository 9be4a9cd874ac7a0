"""Bounds of a pool's waiting room: who is shed when it is full, and when to come back.

Shedding: a pool holds at most `max_queued` requests and `max_queued_bytes` of their bodies. A
newcomer that does not fit displaces requests of a strictly lower band, the lowest band first; inside
that band the tenant that has received the most service (largest virtual counter) loses its newest
request first (it has waited least). A newcomer that would have to displace its own band or a higher
one is turned away itself.

Retry-after: the requests ahead of a caller divided by the rate at which the room has recently been
dispatching (an exponentially decayed count of dispatches), in whole seconds within [1, 60] (older
openai SDKs ignore longer waits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Held:
    """A waiting request as the bounds see it."""

    seq: int
    band: int
    tenant: str
    body_bytes: int


def shed_for(
    held: Sequence[Held],
    counter: Callable[[int, str], float],
    *,
    band: int,
    body_bytes: int,
    max_queued: int,
    max_queued_bytes: int,
) -> list[int] | None:
    """The `seq`s to shed so that a newcomer of `band` and `body_bytes` fits (empty: it fits as is);
    None when it cannot fit without displacing its own band or a higher one (turn it away)."""
    count = len(held) + 1
    total = sum(h.body_bytes for h in held) + body_bytes
    if count <= max_queued and total <= max_queued_bytes:
        return []
    if body_bytes > max_queued_bytes:
        return None
    victims = sorted(
        (h for h in held if h.band > band),
        key=lambda h: (-h.band, -counter(h.band, h.tenant), -h.seq),
    )
    shed: list[int] = []
    for victim in victims:
        if count <= max_queued and total <= max_queued_bytes:
            break
        shed.append(victim.seq)
        count -= 1
        total -= victim.body_bytes
    if count <= max_queued and total <= max_queued_bytes:
        return shed
    return None


def retry_after_s(ahead: int, drain_per_s: float, *, unknown_s: float, floor_s: int = 1, cap_s: int = 60) -> int:
    """Whole seconds until `ahead` requests have left at `drain_per_s`; `unknown_s` when nothing has
    drained lately (no rate to go by)."""
    seconds = (ahead + 1) / drain_per_s if drain_per_s > 1e-9 else unknown_s
    return int(min(max(math.ceil(seconds), floor_s), cap_s))


class DrainRate:
    """Dispatches per second out of a waiting room, exponentially decayed over `time_constant_s`."""

    __slots__ = ("_at_s", "_rate", "time_constant_s")

    def __init__(self, time_constant_s: float = 10.0) -> None:
        self.time_constant_s = time_constant_s
        self._rate = 0.0
        self._at_s = 0.0

    def record(self, now_s: float, count: int = 1) -> None:
        self._rate = self.per_s(now_s) + count / self.time_constant_s
        self._at_s = now_s

    def per_s(self, now_s: float) -> float:
        if not self._rate:
            return 0.0
        return self._rate * math.exp(-max(now_s - self._at_s, 0.0) / self.time_constant_s)

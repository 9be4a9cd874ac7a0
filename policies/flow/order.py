"""Which waiting request goes next: a pure function of what waits and the virtual counters.

1. Strict priority: the lowest-ranked band with anyone waiting (critical before high before ...).
2. Inside it, the tenant with the smallest virtual counter (`vtc.py`); ties go to the tenant with
   fewer requests waiting (a returning tenant is lifted to exactly the least waiting counter, so a
   light tenant wins the tie against the tenant flooding the band), then to the earlier arrival.
3. Inside the tenant, its earliest request, or with shortest-job-first its request of least
   predicted cost (ties by arrival). With program fairness on for the tenant (`programs.py`), its
   request whose program has the least attained service first, then as above inside that program;
   a resumed stream (negative `seq`) still goes first of its tenant's.

`skip` holds requests the caller already found unable to go now for a reason of their own (an SLO no
endpoint meets, say), `skip_tenants` tenants none of whose requests can (the slot reserve): they keep
their place, and the next one in the same order is offered.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class WaitingLike(Protocol):
    """What ordering reads of a waiting request. `seq` is its arrival order in the pool."""

    @property
    def seq(self) -> int: ...

    @property
    def band(self) -> int: ...

    @property
    def cost_tokens(self) -> float: ...


W = TypeVar("W", bound=WaitingLike)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A waiting request as plain data (tests, status pages)."""

    seq: int
    tenant: str
    band: int
    cost_tokens: float


Rank = Callable[[W], float]  # a request's program's attained service (programs.py)


def tenant_candidate(
    waiting: Sequence[W], *, sjf: bool, skip: Container[int] = (), rank: Rank[W] | None = None
) -> W | None:
    """A tenant's own next request (`waiting` in arrival order); `rank`: least first (program fairness)."""
    if rank is not None:
        return _least_attained(waiting, rank, sjf=sjf, skip=skip)
    best: W | None = None
    for item in waiting:
        if item.seq in skip:
            continue
        if not sjf:
            return item
        if best is None or item.cost_tokens < best.cost_tokens:
            best = item  # arrival order breaks ties: an equal later one never replaces it
    return best


def _least_attained(waiting: Sequence[W], rank: Rank[W], *, sjf: bool, skip: Container[int]) -> W | None:
    """The request of least (resumed first, attained service, cost with `sjf`, arrival)."""
    best: W | None = None
    best_key = (False, 0.0, 0.0, 0)
    for item in waiting:
        if item.seq in skip:
            continue
        key = (item.seq >= 0, rank(item), item.cost_tokens if sjf else 0.0, item.seq)
        if best is None or key < best_key:
            best, best_key = item, key
    return best


def pick(
    bands: Iterable[tuple[int, Mapping[str, Sequence[W]]]],
    counter: Callable[[int, str], float],
    *,
    sjf: bool = False,
    skip: Container[int] = (),
    fair: bool = True,
    skip_tenants: Container[str] = (),
    programs: Callable[[str], Rank[W] | None] | None = None,
) -> W | None:
    """The next request to dispatch; None when nothing (not skipped) waits.

    `bands` yields (band rank, tenant -> that tenant's waiting requests in arrival order) in any
    order; `counter(band, tenant)` is the tenant's virtual counter in that band. `fair=False` orders
    a band by arrival alone (priority only, the baseline flow control is measured against).
    `programs(tenant)`: how to rank that tenant's requests by their program's attained service, or
    None where the tenant has no program fairness (its requests go in arrival order).
    """
    for _, tenants in sorted(bands, key=lambda pair: pair[0]):
        chosen: W | None = None
        chosen_key = (0.0, 0, 0)
        for tenant, waiting in tenants.items():
            if tenant in skip_tenants:
                continue
            rank = programs(tenant) if programs is not None else None
            candidate = tenant_candidate(waiting, sjf=sjf, skip=skip, rank=rank)
            if candidate is None:
                continue
            key = (counter(candidate.band, tenant), len(waiting), candidate.seq) if fair else (0.0, 0, candidate.seq)
            if chosen is None or key < chosen_key:
                chosen, chosen_key = candidate, key
        if chosen is not None:
            return chosen
    return None

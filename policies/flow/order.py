"""Who goes next in a saturated pool's waiting room: priority bands, then fair share by virtual token
counters, then, inside a tenant that asks for it, its programs by least attained service.

One decision, in the order it is made: a request's band (strict priority), the tenant of that band with
the least weighted service (its virtual counter, kept in memory here or shared through Redis by
`redis_counters.py`), and inside the tenant its program with the least attained service, then its
earliest (or cheapest) request. `pick` makes it at every free slot; the counters, the programs' attained
service and each tenant's service window are charged at dispatch and corrected when a request ends.
Every read is synchronous, so ordering never waits on a network.

Picking the next request
------------------------

Which waiting request goes next: a pure function of what waits and the virtual counters.

1. Strict priority: the lowest-ranked band with anyone waiting (critical before high before ...).
2. Inside it, the tenant with the smallest virtual counter (below); ties go to the tenant with
   fewer requests waiting (a returning tenant is lifted to exactly the least waiting counter, so a
   light tenant wins the tie against the tenant flooding the band), then to the earlier arrival.
3. Inside the tenant, its earliest request, or with shortest-job-first its request of least
   predicted cost (ties by arrival). With program fairness on for the tenant (below), its
   request whose program has the least attained service first, then as above inside that program;
   a resumed stream (negative `seq`) still goes first of its tenant's.

`skip` holds requests the caller already found unable to go now for a reason of their own (an SLO no
endpoint meets, say), `skip_tenants` tenants none of whose requests can (the slot reserve): they keep
their place, and the next one in the same order is offered.

Bands
-----

Priority bands: a request's band is its principal's priority; a higher band always goes first.

Bands are ranked 0 (critical) to 4 (sheddable) so that sorting by rank is dispatch order.

Virtual token counters
----------------------

Virtual token counters (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI '24).

Each (pool, band) keeps one counter per tenant: the service it received, in tokens, divided by its
weight. Inside a band the waiting tenant with the smallest counter goes next, so over any busy period
two backlogged tenants receive service in the ratio of their weights, within about one request's
cost of each other.

Three rules keep the counters honest:

- *charge at dispatch*: a dispatched request advances its tenant's counter by its predicted cost
  (uncached prompt tokens + predicted output tokens) ÷ weight, so the next decision already sees it;
- *correct at the end*: when the request ends, the difference between its real and predicted cost
  (÷ weight) is added, so a tenant whose outputs run longer than predicted is not favoured for long.
  A refund (real cost below the prediction) is held back and credited at the tenant's next dispatch
  instead: a request ends exactly when a batch slot frees, so a refund landing then would lower the
  flooding tenant's counter at the one moment a waiting light tenant should win the slot;
- *no banked credit*: a tenant with nothing waiting in the band that starts waiting again is lifted
  to the band's current minimum (the smallest counter among the tenants waiting there, or, with
  nobody waiting, the counter of the tenant served last). Idling earns no priority later; usage
  while others waited is remembered.

Everything here is a pure function of numbers; where the counters live is the next section.

Where the counters live
-----------------------

Where the virtual counters live: the contract, and the in-memory store of one gateway process.

Every method is synchronous and O(1): ordering reads counters at every dispatch, so a read never
waits on a network. A shared store (`redis_counters.py`) keeps a local view that it updates at once
and reconciles with Redis in the background; `age_s` says how old the shared part of that view is.

Program-fair queueing
---------------------

Program-fair queueing: inside one tenant, the program that has received the least service lately
goes next (least attained service, LAS), so an agent program's 40 parallel calls do not starve
another program's one.

A tenant's share of a saturated pool is the virtual counters' business (above); this module only
orders the requests *of one tenant* among themselves. Each program (gateway/request/intake.py) has an
attained service: the tokens it was served (uncached prompt + output, the cost the tenant's counter
is charged, charged at dispatch and corrected by real usage at the end), decayed with a half-life so
that a program served heavily a while ago is not held back forever, and a long-running one does not
lose to every newcomer for good. Among the tenant's waiting requests, the one whose program has the
least attained service goes first; inside one program, arrival order (or shortest job first).

Requests that name no program share one group, `NO_PROGRAM`, which is ordered like any program.
Counting each of them as a program of its own would put every anonymous call at zero service, in
front of every named program: dropping the program id would then be the way to jump the queue, and
each such call would be a table entry. As one group, anonymous traffic gets one program's share.

Why decay and not a window: the decayed value needs two numbers per program (the value and when it
was last changed) and one multiplication to read, and it is the same whichever replica reads it.

State is bounded per tenant (`max_programs`, least recently charged forgotten first: a forgotten
program reads as zero service, the same as a new one). Where it lives is a `ProgramService`: one
process (`MemoryPrograms`) or shared by the replicas through Redis (`redis_counters.py`). Every read
is synchronous: ordering reads it at every pick.

Service shares
--------------

Service shares: how much each tenant received of a pool lately, against what its weight entitles.

`ServiceWindow` sums each tenant's cost (the same tokens the virtual counters charge, corrected when a
request ends) over a sliding window in one-second buckets: O(window) memory per tenant, and tenants
are the configured ones.

`fair_share_ratios` is each tenant's share of the service divided by its weight's share among the
tenants served in the window: 1.0 is exactly its weighted share, below 1 it received less (because it
asked for less, or because others were favoured), above 1 more. A tenant that asks for less than its
share reads below 1 without anything being unfair; `bench/fairness` compares against the max-min fair
allocation of what each tenant asked for.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, TypeVar

from policies.schema import PRIORITY_VALUES

BANDS: Final = ("critical", "high", "normal", "low", "sheddable")  # dispatch order
_RANK_BY_PRIORITY: Final = {PRIORITY_VALUES[name]: rank for rank, name in enumerate(BANDS)}


def band_rank(priority: int) -> int:
    """The band of a principal's priority (priorities outside the named ones clamp to the ends)."""
    found = _RANK_BY_PRIORITY.get(priority)
    if found is not None:
        return found
    return 0 if priority > PRIORITY_VALUES["critical"] else len(BANDS) - 1


def band_name(rank: int) -> str:
    return BANDS[rank]


def band_floor(counters: Mapping[str, float], waiting_tenants: Iterable[str], last_served: float) -> float:
    """The counter a returning tenant starts from: the least among the waiting tenants, else the
    counter of the tenant served last."""
    floor: float | None = None
    for tenant in waiting_tenants:
        value = counters.get(tenant, 0.0)
        if floor is None or value < floor:
            floor = value
    return last_served if floor is None else floor


def lifted(counter: float, floor: float) -> float:
    """A returning tenant's counter: never below the band's floor (no banked credit), never lowered."""
    return counter if counter >= floor else floor


def credited(counter: float, credit: float, floor: float | None) -> float:
    """A counter at dispatch: lifted to `floor` (a tenant coming back; None: it was waiting all along),
    then `credit` (held-back refunds, ≤ 0) taken off, never below that floor (no banked credit)."""
    if floor is None:
        return counter + credit
    value = counter if counter >= floor else floor
    value += credit
    return value if value >= floor else floor


def charge(cost_tokens: float, weight: float) -> float:
    """What a dispatch adds to its tenant's counter."""
    return (0.0 if cost_tokens < 0.0 else cost_tokens) / weight  # max(cost, 0.0), without the call


def correction(predicted_cost_tokens: float, actual_cost_tokens: float, weight: float) -> float:
    """What a finished request adds to (or takes from) its tenant's counter: real minus predicted."""
    actual = 0.0 if actual_cost_tokens < 0.0 else actual_cost_tokens  # max(x, 0.0), per request without the call
    predicted = 0.0 if predicted_cost_tokens < 0.0 else predicted_cost_tokens
    return (actual - predicted) / weight


def request_cost(prompt_tokens: int, cached_tokens: int, output_tokens: float) -> float:
    """Tokens a request costs the pool: the prompt tokens it must compute plus the tokens it generates."""
    uncached = prompt_tokens - cached_tokens
    # max(x, 0), twice per request, without the builtin's call (the same value, NaN and -0.0 included)
    return (0 if uncached < 0 else uncached) + (0.0 if output_tokens < 0.0 else output_tokens)


class ServiceWindow:
    __slots__ = ("_buckets", "window_s")

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._buckets: dict[str, deque[list[float]]] = {}  # tenant -> [second, cost] oldest first

    def add(self, tenant: str, cost_tokens: float, now_s: float) -> None:
        second = float(math.floor(now_s))
        buckets = self._buckets.get(tenant)
        if buckets is None:
            buckets = self._buckets[tenant] = deque()
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += cost_tokens
        else:
            buckets.append([second, cost_tokens])
        self._trim(buckets, now_s)

    def _trim(self, buckets: deque[list[float]], now_s: float) -> None:
        oldest = now_s - self.window_s
        while buckets and buckets[0][0] < oldest:
            buckets.popleft()

    def totals(self, now_s: float) -> dict[str, float]:
        """Tenant -> service in the window (tenants with none left out)."""
        out: dict[str, float] = {}
        for tenant, buckets in list(self._buckets.items()):
            self._trim(buckets, now_s)
            if not buckets:
                del self._buckets[tenant]
                continue
            out[tenant] = sum(cost for _, cost in buckets)
        return out


def fair_share_ratios(service: Mapping[str, float], weight: Mapping[str, float]) -> dict[str, float]:
    """Tenant -> (its share of `service`) / (its weight's share among the tenants in `service`)."""
    total = sum(max(v, 0.0) for v in service.values())
    weights = sum(weight.get(t, 1.0) for t in service)
    if total <= 0 or weights <= 0:
        return {}
    return {t: (max(v, 0.0) / total) / (weight.get(t, 1.0) / weights) for t, v in service.items()}


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
        value = credited(state.values.get(tenant, 0.0), credit, floor)
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


NO_PROGRAM: Final = ""  # the group of requests that name no program (program ids are never empty)
MAX_PROGRAMS_PER_TENANT: Final = 4096


def decayed(value: float, elapsed_s: float, half_life_s: float) -> float:
    """`value` after `elapsed_s` seconds of halving every `half_life_s`."""
    if elapsed_s <= 0.0:
        return value
    return value * math.pow(0.5, elapsed_s / half_life_s)


class ProgramService(Protocol):
    """Where programs' attained service lives. `half_life_s` comes with every call: it is the tenant's
    policy, hot-reloaded, and a stored value is only "so much, as of then"."""

    def value(self, tenant: str, program: str, half_life_s: float) -> float:
        """The program's attained service now (0 for a program never charged or forgotten)."""
        ...

    def charge(self, tenant: str, program: str, tokens: float, half_life_s: float) -> None:
        """Add `tokens` (a dispatch's cost, or an end-of-request correction, which may be negative;
        the value never goes below zero)."""
        ...

    def watch(self, tenant: str, program: str, waiting: bool) -> None:
        """The program has requests waiting here (or no longer): a shared store keeps its value fresh."""
        ...

    def programs(self, tenant: str) -> int:
        """Programs remembered for `tenant` (bounded by `max_programs`)."""
        ...

    def status(self) -> dict[str, object]: ...

    async def close(self) -> None: ...


class MemoryPrograms:
    """Attained service of one process: per tenant, program -> (value, when it was last changed),
    least recently charged first, at most `max_programs` of them."""

    source = "memory"

    def __init__(
        self, max_programs: int = MAX_PROGRAMS_PER_TENANT, *, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_programs = max_programs
        self.now = now
        self._tenants: dict[str, OrderedDict[str, tuple[float, float]]] = {}

    def value(self, tenant: str, program: str, half_life_s: float) -> float:
        programs = self._tenants.get(tenant)
        if programs is None:
            return 0.0
        found = programs.get(program)
        if found is None:
            return 0.0
        return decayed(found[0], self.now() - found[1], half_life_s)

    def charge(self, tenant: str, program: str, tokens: float, half_life_s: float) -> None:
        programs = self._tenants.get(tenant)
        if programs is None:
            programs = self._tenants[tenant] = OrderedDict()
        now = self.now()
        found = programs.pop(program, None)
        value = tokens if found is None else decayed(found[0], now - found[1], half_life_s) + tokens
        programs[program] = (max(value, 0.0), now)
        if len(programs) > self.max_programs:
            programs.popitem(last=False)

    def watch(self, tenant: str, program: str, waiting: bool) -> None:
        return None

    def programs(self, tenant: str) -> int:
        return len(self._tenants.get(tenant, ()))

    def status(self) -> dict[str, object]:
        return {"store": self.source, "programs": sum(len(p) for p in self._tenants.values())}

    async def close(self) -> None:
        return None


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


Rank = Callable[[W], float]  # a request's program's attained service (MemoryPrograms)


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

"""Tool-boundary affinity: an agent program whose answer ended in tool calls comes back, within a
tool run, with a longer prompt that starts with everything it just sent and received. Its prefix is
in the KV cache of the replica that served it; keep the return there, and keep that room.

Three pieces, all plain state and functions (the gateway feeds them, `gateway/transport/observers.py`):

- `GapLearner`: per tenant, the p90 (`quantile`) of the last `window` tool-call gaps (a tool-call
  answer's end to its program's next request), clamped to [`min_ttl_s`, `max_ttl_s`]: the TTL of a
  pending return. Before `min_samples` gaps the tenant's TTL is `default_ttl_s`. A p90 rather than a
  mean: tool runs are heavy-tailed (a file read, then a test suite), and a TTL that covers most
  returns costs only the reservation of the few that never come.
- `ToolReturns`: program -> (pool, endpoint, expected prefix tokens, when), per tenant, bounded
  (`max_programs_per_tenant`, least recently noted forgotten first; `max_tenants` likewise). An entry
  is *active* while younger than its tenant's TTL, and remembered until `max_ttl_s` so that a late
  return still teaches the learner its gap. Active entries are summed per endpoint: the tokens of
  prefixes expected back there (`reserved`).
- `ToolAffinityScorer` (registered as `tool-affinity`): the returning request's holder scores 1
  while its KV use is under `pressure_threshold`; every other request sees an endpoint's pending
  returns as KV already taken, so unrelated work drifts to replicas with room instead of evicting
  prefixes that are about to be read again.

Shared by gateway replicas (`state: redis`): each replica's router tells its `ToolShare` (the replica
bus, gateway/replicas/bus.py) of every note and every return it dispatched, and folds in the others'
(`on_remote_tool_call`, `on_remote_return` in pipeline.py): a program whose tool-call answer one
replica served finds its holder on whichever replica receives its next turn, and every replica's
learner sees every gap. The table itself stays local, so routing reads no Redis.

Why reservation rather than a hard pin: a pin sends the return to its holder however full it got;
vLLM then preempts or the return queues behind the holder's backlog. Counting the expected prefixes
as used KV is the one signal both sides read: the return weighs its hit against the holder's
pressure, the others avoid taking the room the hit needs.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from backends.types import Endpoint
from policies.routing.types import Candidate, RouteContext

DEFAULT_CAPACITY_TOKENS = 500_000  # an endpoint whose engine reports no KV size (the prefix index's default)
SWEEP_EVERY_S = 0.05  # expired entries are swept at most this often (routing reads them on every request)


@dataclass(frozen=True, slots=True)
class PendingReturn:
    """Where a program's tool-call answer was served, and what its return will find cached there."""

    pool: str
    endpoint_id: str
    prefix_tokens: int  # the answered prompt + its output: the next prompt's expected cached prefix
    noted_s: float


@dataclass(slots=True)
class _Gaps:
    samples: deque[float]
    ttl_s: float


class GapLearner:
    """Per tenant, the `quantile` of the last `window` tool-call gaps, clamped: the TTL of a return."""

    def __init__(
        self,
        *,
        window: int = 128,
        quantile: float = 0.9,
        min_samples: int = 5,
        min_ttl_s: float = 1.0,
        max_ttl_s: float = 300.0,
        default_ttl_s: float = 30.0,
        max_tenants: int = 1_000,
    ) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError("quantile must be in (0, 1]")
        if not 0 < min_ttl_s <= default_ttl_s <= max_ttl_s:
            raise ValueError("need 0 < min_ttl_s <= default_ttl_s <= max_ttl_s")
        if window < 1 or min_samples < 1 or max_tenants < 1:
            raise ValueError("window, min_samples and max_tenants must be >= 1")
        self.window = window
        self.quantile = quantile
        self.min_samples = min_samples
        self.min_ttl_s = min_ttl_s
        self.max_ttl_s = max_ttl_s
        self.default_ttl_s = default_ttl_s
        self.max_tenants = max_tenants
        self._tenants: OrderedDict[str, _Gaps] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tenants)

    def ttl_s(self, tenant: str) -> float:
        gaps = self._tenants.get(tenant)
        return self.default_ttl_s if gaps is None else gaps.ttl_s

    def observe(self, tenant: str, gap_s: float) -> None:
        """One program came back `gap_s` after its tool-call answer ended."""
        if not gap_s >= 0.0:  # NaN and negatives (a clock step) teach nothing
            return
        tenants = self._tenants
        gaps = tenants.get(tenant)
        if gaps is None:
            gaps = tenants[tenant] = _Gaps(deque(maxlen=self.window), self.default_ttl_s)
            while len(tenants) > self.max_tenants:
                tenants.popitem(last=False)
        else:
            tenants.move_to_end(tenant)
        gaps.samples.append(gap_s)
        if len(gaps.samples) >= self.min_samples:
            ordered = sorted(gaps.samples)  # at most `window` values, once per returning program
            rank = min(int(self.quantile * len(ordered)), len(ordered) - 1)
            gaps.ttl_s = min(max(ordered[rank], self.min_ttl_s), self.max_ttl_s)


class ToolReturns:
    """Programs expected back after a tool run, per tenant (bounded), and the KV their prefixes hold."""

    def __init__(self, learner: GapLearner | None = None, *, max_programs_per_tenant: int = 10_000) -> None:
        if max_programs_per_tenant < 1:
            raise ValueError("max_programs_per_tenant must be >= 1")
        self.learner = learner if learner is not None else GapLearner()
        self.max_programs_per_tenant = max_programs_per_tenant
        # tenant -> program -> pending, oldest noted first; `_active` is the part younger than the TTL
        self._active: OrderedDict[str, OrderedDict[str, PendingReturn]] = OrderedDict()
        self._lingering: dict[str, OrderedDict[str, PendingReturn]] = {}
        self._reserved: dict[str, dict[str, int]] = {}  # pool -> endpoint id -> tokens of active entries
        self.noted = 0
        self.returned = 0
        self._swept_s = float("-inf")

    def __len__(self) -> int:
        return sum(map(len, self._active.values())) + sum(map(len, self._lingering.values()))

    # -- what the gateway tells it ---------------------------------------------------------------

    def note_tool_call(
        self, tenant: str, program: str, pool: str, endpoint_id: str, prefix_tokens: int, now_s: float
    ) -> None:
        """`program`'s answer on `endpoint_id` ended in tool calls at `now_s`: expect it back there."""
        self._drop(tenant, program)
        active = self._active.get(tenant)
        if active is None:
            active = self._active[tenant] = OrderedDict()
            while len(self._active) > self.learner.max_tenants:
                gone, entries = self._active.popitem(last=False)
                for entry in entries.values():
                    self._unreserve(entry)
                self._lingering.pop(gone, None)
        else:
            self._active.move_to_end(tenant)
        entry = PendingReturn(pool, endpoint_id, max(int(prefix_tokens), 0), now_s)
        active[program] = entry
        self._reserve(entry, entry.prefix_tokens)
        self.noted += 1
        while len(active) + len(self._lingering.get(tenant, ())) > self.max_programs_per_tenant:
            lingering = self._lingering.get(tenant)
            if lingering:
                lingering.popitem(last=False)
            else:
                self._unreserve(active.popitem(last=False)[1])

    def returned_now(self, tenant: str, program: str, now_s: float) -> float | None:
        """`program` sent its next request (it was dispatched): learn the gap, forget the entry. The
        gap, or None when no return was pending (nothing to tell other replicas)."""
        entry = self._drop(tenant, program)
        if entry is None:
            return None
        self.returned += 1
        gap_s = now_s - entry.noted_s
        self.learner.observe(tenant, gap_s)
        return gap_s

    def returned_elsewhere(self, tenant: str, program: str, gap_s: float) -> None:
        """Another gateway replica dispatched `program`'s return `gap_s` after its tool-call answer:
        its entry here is done, and the gap teaches this replica's learner too."""
        self._drop(tenant, program)
        self.learner.observe(tenant, gap_s)

    # -- what routing reads ------------------------------------------------------------------------

    def pending(self, tenant: str, program: str | None, pool: str, now_s: float) -> PendingReturn | None:
        """The program's active return on `pool` (younger than its tenant's TTL), if any."""
        if program is None:
            return None
        active = self._active.get(tenant)
        entry = active.get(program) if active is not None else None
        if entry is None or entry.pool != pool or now_s - entry.noted_s > self.learner.ttl_s(tenant):
            return None
        return entry

    def reserved(self, pool: str, now_s: float) -> Mapping[str, int]:
        """Endpoint id -> tokens of the prefixes expected back there (active entries), for `pool`.
        Entries are swept at most every `SWEEP_EVERY_S`: a return may reserve that much past its TTL."""
        if now_s - self._swept_s >= SWEEP_EVERY_S or now_s < self._swept_s:
            self.expire(now_s)
        return self._reserved.get(pool, _NONE)

    def expire(self, now_s: float) -> None:
        """Entries past their tenant's TTL stop reserving; past `max_ttl_s` they are forgotten."""
        self._swept_s = now_s
        learner = self.learner
        for tenant, active in self._active.items():
            ttl = learner.ttl_s(tenant)
            while active:
                program, entry = next(iter(active.items()))
                if now_s - entry.noted_s <= ttl:
                    break
                del active[program]
                self._unreserve(entry)
                self._lingering.setdefault(tenant, OrderedDict())[program] = entry
        for tenant in [t for t, entries in self._lingering.items() if not entries]:
            del self._lingering[tenant]
        for lingering in self._lingering.values():
            while lingering and now_s - next(iter(lingering.values())).noted_s > learner.max_ttl_s:
                lingering.popitem(last=False)

    # -- internals ---------------------------------------------------------------------------------

    def _drop(self, tenant: str, program: str) -> PendingReturn | None:
        active = self._active.get(tenant)
        entry = active.pop(program, None) if active is not None else None
        if entry is not None:
            self._unreserve(entry)
            return entry
        lingering = self._lingering.get(tenant)
        return lingering.pop(program, None) if lingering is not None else None

    def _reserve(self, entry: PendingReturn, tokens: int) -> None:
        by_endpoint = self._reserved.setdefault(entry.pool, {})
        total = by_endpoint.get(entry.endpoint_id, 0) + tokens
        if total > 0:
            by_endpoint[entry.endpoint_id] = total
        else:
            by_endpoint.pop(entry.endpoint_id, None)
            if not by_endpoint:
                del self._reserved[entry.pool]

    def _unreserve(self, entry: PendingReturn) -> None:
        self._reserve(entry, -entry.prefix_tokens)


_NONE: Mapping[str, int] = {}


class ToolShare(Protocol):
    """Where a router tells other gateway replicas of its tool-call notes and returns (the replica
    bus): called on the hot path, so an implementation only queues them."""

    def tool_noted(self, tenant: str, program: str, endpoint: Endpoint, prefix_tokens: int, now_s: float) -> None: ...

    def tool_returned(self, tenant: str, program: str, gap_s: float) -> None: ...


def capacity_tokens(candidate: Candidate) -> int:
    """The endpoint's KV size in tokens as its engine reports it, else `DEFAULT_CAPACITY_TOKENS`."""
    return candidate.endpoint.stats.kv_capacity_tokens or DEFAULT_CAPACITY_TOKENS


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolAffinityScorer:
    """Keeps a program's return after a tool call on the replica that holds its prefix, and keeps
    other traffic from filling that replica's KV meanwhile.

    For the program's next request within its TTL (`RouteContext.tool_return`), with p the holder's
    KV pressure (`EndpointStats.kv_usage_ratio`) and t = `pressure_threshold`:

        holder:  score = 1                         p <= t
                 score = (1 - p) / (1 - t)         p > t (down to 0 when full: weighed, not forced)
        others:  score = 0

    For every other request, an endpoint's pending returns count as KV in use (R: their expected
    prefix tokens, `RouteContext.reserved_tokens`; C: its KV capacity in tokens):

        score = 1 - min(R / C, 1)

    Range [0, 1]; saturated (stale) candidates score 0 in both cases. Reads:
    `RouteContext.tool_return`, `RouteContext.reserved_tokens` (the router's `ToolReturns`, fed by
    the gateway when an answer ends in tool calls), `EndpointStats.kv_usage_ratio`, `num_gpu_blocks`.
    """

    pressure_threshold: float = 0.9
    consumes = ("tool-returns", "stats.kv_usage_ratio")

    def __post_init__(self) -> None:
        if not 0.0 <= self.pressure_threshold < 1.0:
            raise ValueError("pressure_threshold must be in [0, 1)")

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[float]:
        back = ctx.tool_return
        if back is not None:
            return [0.0 if c.saturated or c.id != back.endpoint_id else self._holder(c) for c in candidates]
        reserved = ctx.reserved_tokens
        if not reserved:
            return [0.0 if c.saturated else 1.0 for c in candidates]
        return [0.0 if c.saturated else 1.0 - min(reserved.get(c.id, 0) / capacity_tokens(c), 1.0) for c in candidates]

    def _holder(self, candidate: Candidate) -> float:
        pressure = candidate.endpoint.stats.kv_usage_ratio
        t = self.pressure_threshold
        if pressure <= t:
            return 1.0
        return max((1.0 - pressure) / (1.0 - t), 0.0)

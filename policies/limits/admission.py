"""Admission: reserve a request's tokens, requests, concurrency and dollars before it runs, reconcile them
with what it really used afterwards, and word the "no" with OpenAI's rate-limit headers.

The rejections live here because only admission says this "no": they and the success headers are
worded from the same outcome the reservation returns.

Reserve, then reconcile
-----------------------

Admission: reserve a request's tokens, requests, concurrency and dollars before it runs, and
reconcile them with what it really used afterwards (estimate + reconcile, as TensorZero does).

Before the call, one atomic reservation covers every bucket of (key, tenant, model, key x model,
global): prompt tokens + the output reservation, 1 request, 1 lease, the cost estimate. Charging up
front is what keeps a concurrent burst from passing a TPM limit before any of it is counted
(LiteLLM's flaw). After the call every bucket and budget is corrected by `actual - reserved`:
a refund, or an extra charge that may push a bucket into debt and so delay later requests.

This module decides and words; the store (memory, or Redis behind `FailoverStore`) only counts.

Rejections and rate-limit headers
---------------------------------

The admission's "no" in the terms of the error catalogue (README, "Errors"), worded like OpenAI's own
429s ("Rate limit reached for gpt-4o-mini in organization … on tokens per min (TPM): Limit 50000,
Used 47949, Requested 3006. Please try again in 1.146s.") and naming the rule that said no.

`Rejection.reason` is the fallback trigger: `rate_limited` and `budget_exhausted` may degrade to the
next model; `limiter_unavailable` never does (the store is down for every model).

Rate-limit and retry headers are in OpenAI's format (OpenAI's "Rate limits" guide; openai-python's
_base_client.py). `x-ratelimit-*` describe the tightest bucket of each kind (fewest units left);
resets are Go-style durations (`1s`, `6m0s`, `2m59.56s`) = time until that bucket is full again.
Retry headers carry the true time until the request fits: `retry-after-ms` is what openai-python
reads first, and `retry-after` (whole seconds, rounded up) serves every other client. Waits over a
minute also say `x-should-retry: false`, because older SDKs ignore such delays and would retry at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from policies.estimate import output_reservation
from policies.limits import memory_store
from policies.limits.plan import (
    DIMENSION_LABEL,
    BucketSpec,
    BudgetSpec,
    Charge,
    LeaseSpec,
    Outcome,
    Plan,
    Settlement,
    StoreUnavailable,
)
from policies.policy import Policy
from policies.types import Principal, Rejection, RequestFacts, Usage

NO_RETRY = ("x-should-retry", "false")
Headers = list[tuple[str, str]]
MAX_AUTO_RETRY_S = 60.0
PERIOD_WORD = {"day": "daily", "month": "monthly", "run": "per-run"}


def go_duration(seconds: float) -> str:
    """Go's time.Duration.String() at millisecond resolution, rounded up: 0s, 12ms, 1.5s, 6m0s, 1h2m3s."""
    ms = math.ceil(seconds * 1000 - 1e-6) if seconds > 0 else 0
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_headers(kind: str, limit: float, remaining: float, reset_s: float) -> Headers:
    """The three x-ratelimit-* headers of one kind (`requests` or `tokens`)."""
    return [
        (f"x-ratelimit-limit-{kind}", str(int(limit))),
        (f"x-ratelimit-remaining-{kind}", str(max(0, math.floor(remaining)))),
        (f"x-ratelimit-reset-{kind}", go_duration(reset_s)),
    ]


def retry_headers(wait_s: float) -> Headers:
    """retry-after(-ms) for a wait of `wait_s` seconds (at least 1 ms / 1 s)."""
    headers = [
        ("retry-after", str(max(1, math.ceil(wait_s)))),
        ("retry-after-ms", str(max(1, math.ceil(wait_s * 1000)))),
    ]
    if wait_s > MAX_AUTO_RETRY_S:
        headers.append(("x-should-retry", "false"))
    return headers


def describe(scope: str, subject: str, rule_id: str) -> str:
    """Who shares the limit, as a message fragment: `key 'demo' (rule key[tenant=free])`."""
    if scope == "key":
        who = f"key '{subject}'"
    elif scope == "tenant":
        who = f"tenant '{subject}'"
    elif scope == "model":
        who = "all callers of the model"
    elif scope == "key_model":
        who = f"key '{subject.split('/', 1)[0]}' on this model"
    elif scope in ("team", "tag"):
        who = f"{scope} '{subject}'"
    elif scope == "org":
        who = f"organisation '{subject}'"
    elif scope == "team_provider":
        team, _, provider = subject.partition("/")
        who = f"team '{team}' on {provider}"
    elif scope == "user":
        who = f"end user '{subject.split('/', 1)[-1]}'"
    elif scope == "program":
        who = f"agent run '{subject.split('/', 1)[-1]}'"
    else:
        who = "the gateway (global)"
    return f"{who} (rule {rule_id})"


def _amount(x: float) -> str:
    """Whole units from 100 up; below, one decimal at most (a bucket drains continuously)."""
    if abs(x) >= 100:
        return str(round(x))
    return f"{x:.1f}".rstrip("0").rstrip(".")


def rate_limited(
    model: str,
    spec: BucketSpec | LeaseSpec,
    *,
    capacity: float,
    used: float,
    requested: float,
    wait_s: float,
    headers: Headers,
) -> Rejection:
    kind = spec.kind if isinstance(spec, BucketSpec) else "requests"
    label = DIMENSION_LABEL[spec.dimension if isinstance(spec, BucketSpec) else "max_concurrent"]
    never = math.isinf(wait_s)  # a cap that does not refill (an agent run's): waiting cannot help
    message = (
        f"Rate limit reached for {model} in {describe(spec.scope, spec.subject, spec.rule_id)} on {label}: "
        f"Limit {_amount(capacity)}, Used {_amount(used)}, Requested {_amount(requested)}. "
        + ("This cap does not reset." if never else f"Please try again in {go_duration(wait_s)}.")
    )
    return Rejection(
        status=429,
        message=message,
        type=kind,
        code="rate_limit_exceeded",
        headers=(NO_RETRY, *headers) if never else (*retry_headers(wait_s), *headers),
        reason="rate_limited",
        fallback_model=spec.fallback,
    )


def run_time_exceeded(model: str, spec: BucketSpec, *, capacity: float, elapsed_s: float, now_s: float) -> Rejection:
    """An agent run past its wall-clock cap (`seconds_per_run`, or the run's header): its clock never
    turns back, so no retry, as for the run's other caps. The message says when the run started."""
    started = datetime.fromtimestamp(now_s - elapsed_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    message = (
        f"Time limit reached for {model} in {describe(spec.scope, spec.subject, spec.rule_id)} on "
        f"{DIMENSION_LABEL[spec.dimension]}: Limit {_amount(capacity)}s, the run started at {started}, "
        f"{_amount(elapsed_s)}s ago. This cap does not reset."
    )
    return Rejection(
        status=429,
        message=message,
        type="seconds",
        code="rate_limit_exceeded",
        headers=(NO_RETRY,),
        reason="rate_limited",
        fallback_model=spec.fallback,
    )


def too_large(model: str, spec: BucketSpec, *, capacity: float, requested: float) -> Rejection:
    """The request exceeds the bucket's whole capacity: waiting cannot help, so no retry."""
    message = (
        f"Request too large for {model} in {describe(spec.scope, spec.subject, spec.rule_id)} on "
        f"{DIMENSION_LABEL[spec.dimension]}: Limit {_amount(capacity)}, Requested {_amount(requested)}. "
        "The input or output tokens must be reduced in order to run successfully."
    )
    return Rejection(
        status=429,
        message=message,
        type=spec.kind,
        code="rate_limit_exceeded",
        headers=(NO_RETRY,),
        reason="rate_limited",
        fallback_model=spec.fallback,
    )


def usd(amount: float) -> str:
    """Dollars with the cents always shown and as many more digits as the amount needs, to the
    micro-dollar: `5.00`, `0.005`, `0.000123`; an amount that is not zero never reads `0.00` (a
    budget of half a cent is a real test setting, and "$0.00" tells its owner nothing)."""
    if amount != 0 and abs(amount) < 5e-7:  # below a micro-dollar: two significant digits
        return f"{amount:.2g}"
    whole, _, cents = f"{amount:.6f}".rstrip("0").partition(".")
    return f"{whole}.{cents.ljust(2, '0')}"


def budget_exhausted(
    model: str, spec: BudgetSpec, *, spent_usd: float, cost_usd: float, resets_at_s: float, now_s: float
) -> Rejection:
    """A budget that this request would overrun. The reset is in the message and in headers: the
    token buckets' `x-ratelimit-reset-*` (here `-usd`: Go duration to the period's end) and, when
    waiting helps (the request fits a whole budget), `retry-after(-ms)`; a reset over a minute away
    says `x-should-retry: false` as every long wait does. A request costing more than the whole
    budget never fits: no retry-after, and never retried."""
    never = math.isinf(resets_at_s)  # an agent run's budget: one period
    resets = "" if never else datetime.fromtimestamp(resets_at_s, UTC).strftime("%Y-%m-%dT%H:%MZ")
    message = (
        f"You exceeded your current quota: the {PERIOD_WORD.get(spec.period, 'billing-period')} budget of "
        f"{describe(spec.scope, spec.subject, spec.rule_id)} is ${usd(spec.limit_usd)}, "
        f"${usd(spent_usd)} is spent and this request to {model} may cost up to ${usd(cost_usd)}. "
        + ("The budget does not reset." if never else f"The budget resets at {resets}.")
    )
    wait_s = max(0.0, resets_at_s - now_s)
    budget = [
        ("x-ratelimit-limit-usd", usd(spec.limit_usd)),
        ("x-ratelimit-remaining-usd", usd(max(0.0, spec.limit_usd - spent_usd))),
    ]
    if not never:
        budget.append(("x-ratelimit-reset-usd", go_duration(wait_s)))
    fits_later = cost_usd <= spec.limit_usd and not never
    retry = retry_headers(wait_s) if fits_later else [NO_RETRY]
    return Rejection(
        status=429,
        message=message,
        type="insufficient_quota",
        code="insufficient_quota",
        headers=(*retry, *budget),
        reason="budget_exhausted",
        fallback_model=spec.fallback,
    )


def limiter_unavailable(retry_after_s: float) -> Rejection:
    return Rejection(
        status=503,
        message="The rate limiter's store is unavailable and the policy fails closed; try again shortly.",
        type="server_error",
        code="limiter_unavailable",
        headers=tuple(h for h in retry_headers(retry_after_s) if h[0] != "x-should-retry"),
        reason="limiter_unavailable",
    )


log = logging.getLogger(__name__)
_SHARED_SCOPES = frozenset({"key", "tenant", "global"})  # limits that hold whatever the model (precheck)


class Store(Protocol):
    """Counts; decides nothing but fit. `may_suspend` False (memory) = calls never await I/O.

    Optional, used when a store has them: `apply_soon(plan, settlement, now_s, lazy=)` starts a settlement
    at once and returns what completes it (None when already done; it never raises, failures are
    the store's to retry), and `abandon(plan, charge, now_s)` undoes a reservation whose caller gave
    up while it was on its way, whether or not it ran."""

    may_suspend: bool

    async def reserve(self, plan: Plan, charge: Charge, now_s: float | None = None) -> Outcome: ...

    async def apply(self, plan: Plan, settlement: Settlement, now_s: float | None = None) -> Any: ...

    def snapshot(self) -> list[dict[str, Any]]: ...

    def status(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class PolicySource(Protocol):
    @property
    def current(self) -> Policy: ...


@dataclass(slots=True)
class _Fixed:
    current: Policy


@dataclass(slots=True)
class Admitted:
    """A reservation. `headers` are the x-ratelimit-* of the tightest bucket of each kind."""

    headers: tuple[tuple[str, str], ...]
    model: str
    ticket_id: str = ""
    plan: Plan | None = None
    bucket_costs: list[float] = field(default_factory=list)
    cost_usd: float = 0.0  # reserved estimate
    budget_periods: list[int] = field(default_factory=list)
    source: str = "none"  # the store that admitted it: memory | redis | local | none
    generation: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # the output reservation
    shadow_exceeded: tuple[str, ...] = ()  # shadow rules this request went over
    settled: bool = False
    actual_cost_usd: float | None = None  # set by settle
    price_factor: float = 1.0  # a batch line's share of the price (both the estimate and the actual)
    key_id: str = ""  # whose spend it holds (`Admission.open_usd`)


class Admission:
    """The gateway's admission port: `admit`, then exactly one of `settle` or `release`."""

    def __init__(
        self, policies: PolicySource | Policy, store: Store, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._policies: PolicySource = _Fixed(policies) if isinstance(policies, Policy) else policies
        self.store = store
        self._clock = clock
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(6).hex() + "-"
        self._store_suspends = getattr(store, "may_suspend", True)
        self._apply_soon: Callable[..., asyncio.Future[Any] | None] | None = getattr(store, "apply_soon", None)
        self._abandon: Callable[[Plan, Charge, float | None], Coroutine[Any, Any, Any]] | None = getattr(
            store, "abandon", None
        )
        self._tasks: set[asyncio.Future[Any]] = set()  # settlements and undos still on their way
        self.counters: Counter[str] = Counter()
        self.shadow_counters: Counter[str] = Counter()
        # dollars the open reservations of each key hold in its spend counters (spend reconciliation,
        # gateway/ledger/reconcile.py); bounded by the requests in flight
        self.open_usd: dict[str, float] = {}

    @property
    def policy(self) -> Policy:
        """The policy the next admission will use (the holder's current one)."""
        return self._policies.current

    # ------------------------------------------------------------------ admit
    async def admit(self, facts: RequestFacts, model: str, now: float | None = None) -> Admitted | Rejection:
        """Reserve `facts.prompt_tokens` + the output reservation, one request, one lease and the cost
        estimate in every bucket of (key, tenant, model, key x model, global) at once, or none.
        `now` (epoch s) overrides the store's clock (tests)."""
        policy = self._policies.current
        plan = policy.admission_plan(facts.principal, model, facts.subjects)
        prompt_tokens = facts.prompt_tokens
        model_config = policy.model_config(model)
        output_tokens = _output_tokens(facts, model, plan, model_config.context_length if model_config else None)
        factor = policy.batch_price_factor(model) if facts.batch_id else 1.0
        if not (plan.buckets or plan.leases or plan.budgets):
            self.counters["admitted"] += 1
            return Admitted(
                (), model, plan=plan, prompt_tokens=prompt_tokens, output_tokens=output_tokens, price_factor=factor
            )
        costs = [spec.reserve_cost(prompt_tokens, output_tokens) for spec in plan.buckets]
        cost_usd = plan.reserve_usd(prompt_tokens, output_tokens) * factor if plan.budgets else 0.0
        never = self._never_fits(plan, model, costs, cost_usd, now)
        if never is not None:
            self.counters[never.reason] += 1
            return never
        charge = Charge(f"{self._id_prefix}{next(self._ids):x}", costs, cost_usd)
        outcome = await self._reserved_or_refused(plan, model, charge, now)
        if isinstance(outcome, Rejection):
            return outcome
        shadow = self._shadow_exceeded(plan, charge, outcome)
        key_id = facts.principal.key_id
        if cost_usd:
            self.open_usd[key_id] = self.open_usd.get(key_id, 0.0) + cost_usd
        return Admitted(
            headers=tuple(_success_headers(plan, costs, outcome)),
            model=model,
            ticket_id=charge.ticket_id,
            plan=plan,
            bucket_costs=costs,
            cost_usd=cost_usd,
            budget_periods=outcome.budget_periods,
            source=outcome.source,
            generation=getattr(getattr(self.store, "local", None), "generation", 0),
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            shadow_exceeded=shadow,
            price_factor=factor,
            key_id=key_id,
        )

    async def precheck(self, principal: Principal, model: str, now: float | None = None) -> Rejection | None:
        """Before a request's expensive work (its prompt counted): the 429 `admit` would give any
        request of this caller now, from state this process holds (the memory store's, or the Redis
        mirror's fresh entries; Redis is not asked), or None. Judges only limits every model shares
        (key, tenant and global scopes), so a model's own limit still leaves its fallback chain to
        `admit`; a request limit at its capacity, a token limit with no token left or every
        concurrency slot taken refuses. Charges nothing."""
        plan = self._policies.current.admission_plan(principal, model)
        if not (plan.buckets or plan.leases):
            return None  # no limit at all (a budget is `admit`'s to judge): nothing to look through
        shared = [i for i, spec in enumerate(plan.buckets) if spec.scope in _SHARED_SCOPES and not spec.shadow]
        leases = [i for i, lease in enumerate(plan.leases) if lease.scope in _SHARED_SCOPES and not lease.shadow]
        if not (shared or leases):
            return None
        # only the shared limits are read: a budget or a model's own bucket is `admit`'s to judge
        narrow = dataclasses.replace(
            plan,
            buckets=tuple(plan.buckets[i] for i in shared),
            leases=tuple(plan.leases[i] for i in leases),
            budgets=(),
        )
        charge = Charge("", [1.0] * len(shared), 0.0)  # one request, one token
        peek_now: Callable[[Plan, float], Outcome] | None = getattr(self.store, "peek_now", None)
        mirror = getattr(self.store, "mirror", None)
        if peek_now is not None:
            outcome = peek_now(narrow, self._clock() if now is None else now)
        elif mirror is not None:
            store_now: Callable[[float | None], float] = getattr(self.store, "store_now", lambda n: self._clock())
            found: Outcome | None = mirror.precheck(narrow, charge, store_now(now))
            if found is None:
                return None
            outcome = found
        else:
            return None
        short = any(
            used + 1.0 > spec.capacity * outcome.capacity_scale
            for spec, used in zip(narrow.buckets, outcome.bucket_used, strict=True)
        ) or any(
            active + 1 > max(1, math.ceil(lease.capacity * outcome.capacity_scale))
            for lease, active in zip(narrow.leases, outcome.lease_active, strict=True)
        )
        if not short:
            return None
        rejection = self._rejection(narrow, model, charge, outcome)
        self.counters["precheck_" + (rejection.reason or "rejected")] += 1
        return rejection

    async def admit_request(self, principal: Principal, label: str, now: float | None = None) -> Admitted | Rejection:
        """One request, and nothing else, against the request limits (RPM, RPD) of the caller's key and
        tenant: for calls that run no model (the Files and Batch APIs), which are still requests a
        rate limit must see. No tokens, concurrency slot or dollars are charged: none is used, and a
        key busy with long streams can still read its files. `label` names what was called in the
        429's message (where a model's name goes). Settle the ticket (a no-op correction) like any."""
        full = self._policies.current.admission_plan(principal, "")
        plan = dataclasses.replace(
            full,
            model="",
            buckets=tuple(s for s in full.buckets if s.scope in ("key", "tenant") and s.kind == "requests"),
            leases=(),
            budgets=(),
            encoded={},  # a store's encoding of the full plan is not this one's
        )
        if not plan.buckets:
            self.counters["admitted"] += 1
            return Admitted((), "", plan=plan)
        costs = [1.0] * len(plan.buckets)
        charge = Charge(f"{self._id_prefix}{next(self._ids):x}", costs, 0.0)
        outcome = await self._reserved_or_refused(plan, label, charge, now)
        if isinstance(outcome, Rejection):
            return outcome
        return Admitted(
            headers=tuple(_success_headers(plan, costs, outcome)),
            model="",
            ticket_id=charge.ticket_id,
            plan=plan,
            bucket_costs=costs,
            budget_periods=outcome.budget_periods,
            source=outcome.source,
            generation=getattr(getattr(self.store, "local", None), "generation", 0),
            shadow_exceeded=self._shadow_exceeded(plan, charge, outcome),
        )

    async def _reserved_or_refused(
        self, plan: Plan, label: str, charge: Charge, now: float | None
    ) -> Outcome | Rejection:
        """The store's reservation of `charge`, counted as admitted, or the rejection it earned (counted by
        its reason): one path for a request's tokens and for a Files/Batch call's single request."""
        try:
            outcome = await self._reserve(plan, charge, now)
        except StoreUnavailable as exc:
            self.counters["limiter_unavailable"] += 1
            return limiter_unavailable(exc.retry_after_s)
        if not outcome.admitted:
            rejection = self._rejection(plan, label, charge, outcome, now)
            self.counters[rejection.reason] += 1
            return rejection
        self.counters["admitted"] += 1
        return outcome

    async def _reserve(self, plan: Plan, charge: Charge, now: float | None) -> Outcome:
        """The store's reservation, safe against the caller's cancellation (a client that disconnects
        cancels its handler): a reservation the store made anyway is undone, never leaked."""
        if not self._store_suspends:
            return await self.store.reserve(plan, charge, now)
        if self._abandon is not None:  # awaited directly; on cancellation the store voids the ticket
            try:
                return await self.store.reserve(plan, charge, now)
            except asyncio.CancelledError:
                self._track(asyncio.ensure_future(self._abandon(plan, charge, now)))
                raise
        task = asyncio.ensure_future(self.store.reserve(plan, charge, now))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda done: self._undo_cancelled(plan, charge, done))
            raise

    def _undo_cancelled(self, plan: Plan, charge: Charge, done: asyncio.Future[Outcome]) -> None:
        if done.cancelled() or done.exception() is not None or not done.result().admitted:
            return
        outcome = done.result()
        settlement = Settlement(
            charge.ticket_id,
            outcome.source,
            [-c for c in charge.bucket_costs],
            -charge.cost_usd,
            outcome.budget_periods,
            0.0,
            getattr(getattr(self.store, "local", None), "generation", 0),
        )
        self._start_apply(plan, settlement, None)

    def _start_apply(
        self, plan: Plan, settlement: Settlement, now: float | None, lazy: bool = True
    ) -> asyncio.Future[Any] | None:
        """Begin the store's settlement now; what completes it is tracked (`drain`) and returned.
        `lazy`: nobody waits for it, so the store may hold it back briefly to share a write."""
        if self._apply_soon is not None:
            pending = self._apply_soon(plan, settlement, now, lazy=lazy)
        else:
            pending = asyncio.ensure_future(self.store.apply(plan, settlement, now))
        if pending is not None:
            self._track(pending)
        return pending

    def _track(self, pending: asyncio.Future[Any]) -> None:
        self._tasks.add(pending)
        pending.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for settlements still running in the background (tests, shutdown)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    def _never_fits(
        self, plan: Plan, model: str, costs: list[float], cost_usd: float, now: float | None
    ) -> Rejection | None:
        for spec, cost in zip(plan.buckets, costs, strict=True):
            if not spec.shadow and cost > spec.capacity:
                return too_large(model, spec, capacity=spec.capacity, requested=cost)
        for budget in plan.budgets:
            if not budget.shadow and cost_usd > budget.limit_usd:
                now_s = self._clock() if now is None else now
                end_s = memory_store.period_end_s(budget.period, memory_store.period_id(budget.period, now_s))
                return budget_exhausted(model, budget, spent_usd=0.0, cost_usd=cost_usd, resets_at_s=end_s, now_s=now_s)
        return None

    def _rejection(
        self, plan: Plan, model: str, charge: Charge, outcome: Outcome, now: float | None = None
    ) -> Rejection:
        scale = outcome.capacity_scale
        for budget, spent, pid in zip(plan.budgets, outcome.budget_spent, outcome.budget_periods, strict=True):
            if not budget.shadow and spent + charge.cost_usd > budget.limit_usd * scale:
                return budget_exhausted(
                    model,
                    budget,
                    spent_usd=spent,
                    cost_usd=charge.cost_usd,
                    resets_at_s=memory_store.period_end_s(budget.period, pid),
                    now_s=self._clock() if now is None else now,
                )
        worst: Rejection | None = None
        worst_wait_s = -1.0
        for spec, used, cost in zip(plan.buckets, outcome.bucket_used, charge.bucket_costs, strict=True):
            capacity = spec.capacity * scale
            if spec.shadow or used + cost <= capacity:
                continue
            wait_s = memory_store.wait_s(used, cost, capacity, spec.rate_per_s * scale)
            if wait_s > worst_wait_s:
                worst_wait_s = wait_s
                if spec.kind == "seconds":  # a run's clock: `used` is its age (scaled like the cap)
                    elapsed_s = used / scale if scale else used
                    worst = run_time_exceeded(
                        model, spec, capacity=spec.capacity, elapsed_s=elapsed_s, now_s=outcome.now_s
                    )
                    continue
                reset_s = memory_store.reset_s(used, spec.rate_per_s * scale)
                headers = (
                    ratelimit_headers(spec.kind, capacity, capacity - used, reset_s) if spec.rate_per_s > 0 else []
                )
                worst = rate_limited(
                    model, spec, capacity=capacity, used=used, requested=cost, wait_s=wait_s, headers=headers
                )
        for lease, active in zip(plan.leases, outcome.lease_active, strict=True):
            if lease.shadow or active + 1 <= max(1, math.ceil(lease.capacity * scale)):
                continue
            wait_s = plan.settings.concurrency_retry_after_s
            if wait_s > worst_wait_s:
                worst_wait_s = wait_s
                worst = rate_limited(
                    model, lease, capacity=lease.capacity, used=active, requested=1, wait_s=wait_s, headers=[]
                )
        if worst is None:  # a store said no without a visible cause: treat as briefly unavailable
            return limiter_unavailable(1.0)
        return worst

    def _shadow_exceeded(self, plan: Plan, charge: Charge, outcome: Outcome) -> tuple[str, ...]:
        over: list[str] = []
        for spec, used, cost in zip(plan.buckets, outcome.bucket_used, charge.bucket_costs, strict=True):
            if spec.shadow and used + cost > spec.capacity * outcome.capacity_scale:
                over.append(spec.rule_id)
        for lease, active in zip(plan.leases, outcome.lease_active, strict=True):
            if lease.shadow and active + 1 > lease.capacity:
                over.append(lease.rule_id)
        for budget, spent in zip(plan.budgets, outcome.budget_spent, strict=True):
            if budget.shadow and spent + charge.cost_usd > budget.limit_usd:
                over.append(budget.rule_id)
        for rule_id in over:
            self.shadow_counters[rule_id] += 1
        return tuple(over)

    # ------------------------------------------------------------------ settle, release
    async def settle(
        self,
        ticket: Admitted,
        usage: Usage | None,
        *,
        model: str,
        charged_output_tokens: int | None = None,
        now: float | None = None,
        pool: str | None = None,
    ) -> None:
        """Reconcile with real usage and release the lease. `usage=None` (the stream broke before usage
        arrived) charges `charged_output_tokens` if counted, else the whole output reservation. `pool`:
        the pool that served it, whose price applies (`pool_prices`; None: the model's price).
        Idempotent; never raises (accounting must not fail a response that already went out). Waits
        for the store; a cancelled caller does not cut the settlement short."""
        await self._settled(self.settle_soon(ticket, usage, model=model, charged_output_tokens=charged_output_tokens,
                                             now=now, lazy=False, pool=pool))  # fmt: skip

    def settle_soon(
        self,
        ticket: Admitted,
        usage: Usage | None,
        *,
        model: str,
        charged_output_tokens: int | None = None,
        now: float | None = None,
        lazy: bool = True,
        pool: str | None = None,
    ) -> asyncio.Future[Any] | None:
        """`settle` without waiting: the ticket is settled from now on (a second call is a no-op) and the
        store's work is under way (for Redis, queued on the connection before this returns, so a
        later reservation from this process runs after it); returns what completes it, if anything."""
        if not isinstance(ticket, Admitted) or ticket.settled:
            return None
        ticket.settled = True
        self._closed(ticket)
        try:
            writes = (0, 0, 0)  # cache writes (default lifetime, one hour) and reasoning, billed apart
            if usage is not None:
                prompt, cached, completion = usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
                writes = (usage.cache_write_tokens, usage.cache_write_1h_tokens, usage.reasoning_tokens)
            else:
                prompt, cached = ticket.prompt_tokens, 0
                completion = ticket.output_tokens if charged_output_tokens is None else charged_output_tokens
            plan = ticket.plan
            if plan is None:
                return None
            price = plan.price_at(pool) if model == ticket.model else self._policies.current.price(model, pool)
            actual_usd = (
                price.cost_usd(
                    prompt,
                    cached,
                    completion,
                    cache_write_tokens=writes[0],
                    cache_write_1h_tokens=writes[1],
                    reasoning_tokens=writes[2],
                )
                * ticket.price_factor
            )
            ticket.actual_cost_usd = actual_usd
            if ticket.source == "none":
                return None
            actual = [spec.actual_cost(prompt, cached, completion) for spec in plan.buckets]
            deltas = [cost - reserved for cost, reserved in zip(actual, ticket.bucket_costs, strict=True)]
            settlement = Settlement(
                ticket.ticket_id,
                ticket.source,
                deltas,
                actual_usd - ticket.cost_usd if plan.budgets else 0.0,
                ticket.budget_periods,
                actual_usd,
                ticket.generation,
                actual,
            )
            return self._start_apply(plan, settlement, now, lazy)
        except Exception:
            log.exception("settling ticket %s failed", ticket.ticket_id)
            return None

    async def release(self, ticket: Admitted, now: float | None = None) -> None:
        """The request never reached an engine: undo the whole reservation, request count included."""
        await self._settled(self.release_soon(ticket, now, lazy=False))

    def release_soon(self, ticket: Admitted, now: float | None = None, lazy: bool = True) -> asyncio.Future[Any] | None:
        """`release` without waiting (see `settle_soon`)."""
        if not isinstance(ticket, Admitted) or ticket.settled:
            return None
        ticket.settled = True
        self._closed(ticket)
        ticket.actual_cost_usd = 0.0
        if ticket.source == "none" or ticket.plan is None:
            return None
        settlement = Settlement(
            ticket.ticket_id,
            ticket.source,
            [-c for c in ticket.bucket_costs],
            -ticket.cost_usd,
            ticket.budget_periods,
            0.0,
            ticket.generation,
        )
        try:
            return self._start_apply(ticket.plan, settlement, now, lazy)
        except Exception:
            log.exception("releasing ticket %s failed", ticket.ticket_id)
            return None

    def _closed(self, ticket: Admitted) -> None:
        """The ticket's reservation no longer holds its estimate in the key's counters."""
        if ticket.cost_usd and ticket.key_id in self.open_usd:
            left = self.open_usd[ticket.key_id] - ticket.cost_usd
            if left > 1e-12:
                self.open_usd[ticket.key_id] = left
            else:
                del self.open_usd[ticket.key_id]

    async def _settled(self, pending: asyncio.Future[Any] | None) -> None:
        """Wait for a settlement under way; the caller's cancellation leaves it running."""
        if pending is None:
            return
        try:
            await asyncio.shield(pending)
        except asyncio.CancelledError:
            if pending.cancelled():  # the store gave up on it (closing), not our caller
                return
            raise
        except Exception:
            log.exception("settlement failed")

    # ------------------------------------------------------------------ observability
    def snapshot(self) -> list[dict[str, Any]]:
        """Rows for /admin/status and gauges: each bucket (capacity, used, remaining, reset_s), each
        budget (limit_usd, spent_usd, remaining_usd), each concurrency limit (active)."""
        return self.store.snapshot()

    def status(self) -> dict[str, Any]:
        return {
            **self.store.status(),
            "decisions": dict(self.counters),
            "shadow_exceeded": dict(self.shadow_counters),
        }

    async def close(self) -> None:
        await self.drain()
        await self.store.close()


def _output_tokens(facts: RequestFacts, model: str, plan: Plan, context_length: int | None) -> int:
    """The output reservation: max_tokens x n, else this model's (a fallback model's may differ:
    its default, `min_tokens` and `ignore_eos` against its context; `policies.estimate.output_reservation`)."""
    if facts.api == "embeddings":
        return 0
    if model == facts.model and facts.output_reservation > 0:
        return facts.output_reservation  # the gateway's, which knows what the tenant's requests use
    return output_reservation(
        facts.body if isinstance(facts.body, dict) else {},
        max_tokens=facts.max_tokens,
        estimate_tokens=plan.default_max_tokens,
        context_length=context_length,
        prompt_tokens=facts.prompt_tokens,
    )


def _success_headers(plan: Plan, costs: list[float], outcome: Outcome) -> Headers:
    """x-ratelimit-* of the enforced bucket with the fewest units left, per kind, after this charge."""
    scale = outcome.capacity_scale
    best: dict[str, tuple[float, float, float]] = {}  # kind -> (remaining, capacity, reset_s)
    for spec, used, cost in zip(plan.buckets, outcome.bucket_used, costs, strict=True):
        if spec.shadow or spec.rate_per_s <= 0:  # an agent run's caps and clock: no reset to announce
            continue
        capacity = spec.capacity * scale
        after = used + cost
        remaining = capacity - after
        current = best.get(spec.kind)
        if current is None or remaining < current[0]:
            best[spec.kind] = (remaining, capacity, memory_store.reset_s(after, spec.rate_per_s * scale))
    headers: Headers = []
    for kind in ("requests", "tokens"):
        if kind in best:
            remaining, capacity, reset = best[kind]
            headers += ratelimit_headers(kind, capacity, remaining, reset)
    return headers

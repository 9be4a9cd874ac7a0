"""The plan of each (key, model): the vocabulary of admission (what applies, what a store reports back) and
policies.yaml's limits and budgets compiled into it.

The compiler makes the specs and plans below; the stores, the admission and its headers read them:
the vocabulary and the rules that fill it are one decision, kept in one place.

Vocabulary
----------

Vocabulary of admission: what applies to one (key, model), and what a store reports back.

A `Plan` is compiled once per (key, model) and policy version and reused by every request; only the
per-request amounts (`Charge`) are computed on the hot path. Store keys carry the rule's identity,
the dimension and the subject, never a list position, so counters survive reloads that keep the rule.

Compiling the rules
-------------------

Limits and budgets of policies.yaml compiled into the `Plan` of each (key, model).

Resolution, per scope and per dimension: of the rules of that scope whose `match` fits the request's
(key, tenant, team, organisation, model) and that set the dimension, a rule applies unless another
one is strictly more specific (its match implies this one's; a key implies its tenant, a tenant its
team, a team its organisation). So a rule for key `demo` overrides the rule for every key of tenant
`free`, which overrides the rule for every key, while `key_model` rules for "key k1" and for "model
big" both apply to k1 on big, each with its own bucket. Different scopes always stack: a request of a
key of a team of an organisation reserves in the key's, the tenant's, the team's and the
organisation's counters in one atomic step.

Plans are built on first use and cached for the life of the policy object, so a request costs one
dictionary lookup; a reload builds a new policy and therefore new plans. The request's own subjects
(end user, tags, agent program: `RequestSubjects`) add their scopes' rules to that plan, cached per
subjects in a bounded LRU; a policy without such rules never looks at them.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, TypeVar

from policies.schema import (
    REQUEST_SCOPES,
    RUN_LIMITS,
    BudgetConfig,
    LimitConfig,
    ModelConfig,
    PoliciesConfig,
    PoolPriceConfig,
    TierPriceConfig,
)
from policies.types import OwnLimits, Principal, RequestSubjects

Kind = Literal["requests", "tokens", "seconds"]
# "day" and "month" (UTC), "run" (an agent run's: never resets), or "billing:<anchor day>:<UTC offset s>"
Period = str

# An agent run's caps (`*_per_run`) have an endless window: they never refill (rate 0). Its wall-clock
# cap (`seconds_per_run`) is a bucket that fills instead of draining (`CLOCK_RATE_PER_S`).
DIMENSION_WINDOW_S: dict[str, float] = {
    "rpm": 60.0,
    "rpd": 86_400.0,
    "tpm": 60.0,
    "tpd": 86_400.0,
    "calls_per_run": math.inf,
    "tokens_per_run": math.inf,
    "seconds_per_run": math.inf,
}
DIMENSION_KIND: dict[str, Kind] = {
    "rpm": "requests",
    "rpd": "requests",
    "tpm": "tokens",
    "tpd": "tokens",
    "calls_per_run": "requests",
    "tokens_per_run": "tokens",
    "seconds_per_run": "seconds",
}
DIMENSION_LABEL: dict[str, str] = {
    "rpm": "requests per min (RPM)",
    "rpd": "requests per day (RPD)",
    "tpm": "tokens per min (TPM)",
    "tpd": "tokens per day (TPD)",
    "max_concurrent": "concurrent requests",
    "calls_per_run": "calls per agent run",
    "tokens_per_run": "tokens per agent run",
    "seconds_per_run": "wall-clock seconds per agent run",
}
# A run's clock is a bucket charged nothing per call whose `used` grows by one every second from the
# run's first admitted call: the first reservation writes it (atomically, in the same step as every
# other counter, in memory and in Redis alike), every later one reads the seconds since, and the
# check `used + 0 <= capacity` is "the run is still inside its wall-clock cap". A negative drain
# rate is all it takes: `memory_store.drained` and preamble.lua's `drained` need no special case, and the
# start (`updated_at - used`) survives every rewrite.
CLOCK_RATE_PER_S = -1.0


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One continuous-refill bucket: `capacity` per `window_s`, refilled at `rate_per_s`.

    Token buckets count `w_input * uncached prompt + w_cached * cached prompt + w_output * output`;
    request buckets count 1 per request (weights unused); a run's clock (kind `seconds`) counts
    nothing per request and fills with time (`CLOCK_RATE_PER_S`).
    """

    key: str  # store key (without the store's prefix)
    rule_id: str
    scope: str
    subject: str  # who shares it: "demo", "demo/llama-3.1-8b", "*"
    dimension: str  # rpm | rpd | tpm | tpd
    kind: Kind
    capacity: float
    window_s: float
    rate_per_s: float
    shadow: bool
    w_input: float = 1.0
    w_cached: float = 1.0
    w_output: float = 1.0
    fallback: str | None = None  # the rule's own fallback model when it says no

    def reserve_cost(self, prompt_tokens: int, output_tokens: int) -> float:
        """Conservative: no prompt token is assumed cached before the call."""
        if self.kind == "requests":
            return 1.0
        if self.kind == "seconds":
            return 0.0
        return self.w_input * prompt_tokens + self.w_output * output_tokens

    def actual_cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        if self.kind == "requests":
            return 1.0
        if self.kind == "seconds":
            return 0.0
        cached = min(cached_tokens, prompt_tokens)
        return self.w_input * (prompt_tokens - cached) + self.w_cached * cached + self.w_output * completion_tokens


@dataclass(frozen=True, slots=True)
class LeaseSpec:
    """A concurrency limit: at most `capacity` unexpired leases at once."""

    key: str
    rule_id: str
    scope: str
    subject: str
    capacity: int
    shadow: bool
    fallback: str | None = None


@dataclass(frozen=True, slots=True)
class BudgetSpec:
    """A spend limit per calendar `period` (UTC), charged the request's USD cost."""

    key: str
    rule_id: str
    scope: str
    subject: str
    period: Period
    limit_usd: float
    shadow: bool
    fallback: str | None = None


@dataclass(frozen=True, slots=True)
class Price:
    """USD per token (the config's per-million prices, divided once), with the prompt-cache and
    long-context rules hosted providers bill by.

    A prompt token is billed as one of: a cache read (`cached_input_usd`), a cache write at the
    provider's default lifetime (`cache_write_usd`, Anthropic's 5 minutes) or at one hour
    (`cache_write_1h_usd`), or plain input; an output token as output or, when the provider counts
    it as reasoning (thinking), at `reasoning_usd`. None means "the plain rate" (input, or output
    for reasoning; a 1-hour write defaults to the default write). `long` is the tier that applies
    to the whole request, output included, when its prompt (cache reads and writes included) is
    over `long_above_tokens` tokens: how Anthropic's 1M-context and Gemini's over-200k prices work.
    """

    input_usd: float = 0.0
    cached_input_usd: float = 0.0
    output_usd: float = 0.0
    cache_write_usd: float | None = None
    cache_write_1h_usd: float | None = None
    reasoning_usd: float | None = None
    long: Price | None = None
    long_above_tokens: int = 0

    def tier(self, prompt_tokens: int) -> Price:
        """The price table that applies to a request with `prompt_tokens` of prompt."""
        long = self.long
        return long if long is not None and prompt_tokens > self.long_above_tokens else self

    def cost_usd(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        *,
        cache_write_tokens: int = 0,
        cache_write_1h_tokens: int = 0,
        reasoning_tokens: int = 0,
    ) -> float:
        """What a finished request cost. `prompt_tokens` is the whole prompt (reads and writes
        included); `reasoning_tokens` are part of `completion_tokens`. Counts out of range are
        clamped (a provider's parts never bill more tokens than its totals)."""
        long = self.long
        p = long if long is not None and prompt_tokens > self.long_above_tokens else self  # `tier`, inline
        if (
            not (cached_tokens or cache_write_tokens or cache_write_1h_tokens or reasoning_tokens)
            and prompt_tokens >= 0
            and completion_tokens >= 0
        ):
            # the common request (no cache read or write, no reasoning): nothing to clamp, the same sum
            return prompt_tokens * p.input_usd + completion_tokens * p.output_usd
        cached = min(max(cached_tokens, 0), prompt_tokens)
        write = min(max(cache_write_tokens, 0), prompt_tokens - cached)
        write_1h = min(max(cache_write_1h_tokens, 0), prompt_tokens - cached - write)
        reasoning = min(max(reasoning_tokens, 0), completion_tokens)
        cost = (prompt_tokens - cached - write - write_1h) * p.input_usd + cached * p.cached_input_usd
        cost += (completion_tokens - reasoning) * p.output_usd
        if write:
            cost += write * p.write_usd
        if write_1h:
            cost += write_1h * p.write_1h_usd
        if reasoning:
            cost += reasoning * p.reasoning_rate_usd
        return cost

    def reserve_usd(self, prompt_tokens: int, output_tokens: int) -> float:
        """What a reservation holds before the call: the same tier rule as `cost_usd` on the same
        prompt count, every prompt token at the dearest prompt rate (no read is assumed; a write may
        cost more than input) and every output token at the dearer of output and reasoning, so the
        settlement never exceeds it for a prompt and output within what was reserved."""
        p = self.tier(prompt_tokens)
        prompt_rate = max(p.input_usd, p.cached_input_usd, p.write_usd, p.write_1h_usd)
        return prompt_tokens * prompt_rate + output_tokens * max(p.output_usd, p.reasoning_rate_usd)

    def uncached_usd(self, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int = 0) -> float:
        """What the request would have cost with no prompt cache at all (every prompt token plain
        input): the reference that `usage report`'s cache saving is measured against."""
        return self.cost_usd(prompt_tokens, 0, completion_tokens, reasoning_tokens=reasoning_tokens)

    @property
    def write_usd(self) -> float:
        return self.input_usd if self.cache_write_usd is None else self.cache_write_usd

    @property
    def write_1h_usd(self) -> float:
        return self.write_usd if self.cache_write_1h_usd is None else self.cache_write_1h_usd

    @property
    def reasoning_rate_usd(self) -> float:
        return self.output_usd if self.reasoning_usd is None else self.reasoning_usd


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """The `admission:` section, compiled; read per call so a reload applies to the next request."""

    fail_open: bool = True
    replicas: int = 1
    lease_ttl_s: float = 900.0
    concurrency_retry_after_s: float = 1.0
    local_precheck: bool = True
    breaker_failures: int = 3
    breaker_open_s: float = 2.0


@dataclass(frozen=True, slots=True)
class RunRef:
    """The agent run a plan counts (policies/limits/standing.py): its admitted calls also note it in the
    store's index of live runs, with the key and model that called it last, so the console can find
    the runs whose counters to read."""

    tenant: str
    program: str
    key_id: str

    @property
    def subject(self) -> str:
        """The run's subject in the store (tenant/program), as its counters' keys carry it."""
        return f"{self.tenant}/{self.program}"


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything that applies to one (key, model): compiled once, shared by its requests."""

    model: str
    buckets: tuple[BucketSpec, ...]
    leases: tuple[LeaseSpec, ...]
    budgets: tuple[BudgetSpec, ...]
    price: Price
    default_max_tokens: int
    settings: StoreSettings
    run: RunRef | None = None  # the agent run it counts, if any of its rules is a run's
    # pools with a price of their own for this model (policies.yaml `pool_prices`); the others pay `price`
    pool_prices: tuple[tuple[str, Price], ...] = ()
    # A store's precomputed encoding of this plan (Redis keys and script arguments), filled on first
    # use so the hot path only formats the per-request amounts.
    encoded: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def price_at(self, pool: str | None) -> Price:
        """The price `pool` bills this model at: its own when it has one, else the model's."""
        if pool is not None:
            for name, price in self.pool_prices:
                if name == pool:
                    return price
        return self.price

    def reserve_usd(self, prompt_tokens: int, output_tokens: int) -> float:
        """The reservation before routing, when the serving pool is not known yet: the dearest of
        every price the model may be served at (`Price.reserve_usd` of each), so that it covers the
        settlement at whichever pool serves it."""
        reserved = self.price.reserve_usd(prompt_tokens, output_tokens)
        for _, price in self.pool_prices:
            reserved = max(reserved, price.reserve_usd(prompt_tokens, output_tokens))
        return reserved


@dataclass(slots=True)
class Charge:
    """The amounts one admission reserves: one cost per bucket (plan order) and the USD estimate."""

    ticket_id: str
    bucket_costs: list[float]
    cost_usd: float


@dataclass(slots=True)
class Outcome:
    """A store's answer to a reservation, with the state it decided on (before this charge).

    `bucket_used` etc. are aligned with the plan; `source` names who decided ("memory", "redis",
    "local" for fail-open, "precheck") and is handed back on settle so the same store reconciles.
    `capacity_scale` < 1 when local fail-open buckets hold this replica's share only.
    """

    admitted: bool
    now_s: float
    bucket_used: list[float]
    lease_active: list[int]
    budget_spent: list[float]
    budget_periods: list[int]
    source: str
    capacity_scale: float = 1.0


@dataclass(slots=True)
class Settlement:
    """Corrections after the call: per-bucket and budget deltas (negative = refund), lease release."""

    ticket_id: str
    source: str
    bucket_deltas: list[float]
    budget_delta_usd: float
    budget_periods: list[int]
    actual_cost_usd: float  # fail-open tickets push this to Redis once it is back
    generation: int = 0  # local store generation at admit (fail-open tickets only)
    # what the request really cost in each bucket (plan order): fail-open tickets push it to the
    # shared buckets too, so what a replica admitted on its own is counted everywhere afterwards
    actual_bucket_costs: list[float] = field(default_factory=list)


class StoreUnavailable(Exception):
    """The shared store cannot answer (down, timing out, breaker open)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def ticket_ttl_s(lease_ttl_s: float) -> float:
    """How long an unsettled ticket stays settleable: past any lease, and at least an hour."""
    return max(3600.0, 2.0 * lease_ttl_s)


Rule = TypeVar("Rule", LimitConfig, BudgetConfig)


class OverrideLike(Protocol):
    @property
    def rule(self) -> str: ...
    @property
    def subject(self) -> str | None: ...
    @property
    def dimension(self) -> str: ...
    @property
    def value(self) -> float: ...
    @property
    def until_unix_s(self) -> float: ...


class OverrideSource(Protocol):
    """Where temporary overrides live (policies/keys/index.py `KeyIndex`): a map and its generation."""

    @property
    def overrides(self) -> Mapping[str, OverrideLike]: ...
    @property
    def overrides_generation(self) -> int: ...


# Scopes compiled once per (key, model), in this order; then the request's own (user, tag, program).
SCOPES = ("key", "tenant", "team", "org", "model", "key_model", "team_provider", "global")
ALL_SCOPES = (*SCOPES, *sorted(REQUEST_SCOPES))
# Rule identities of limits set through the admin API and of the key spend counters: '@' cannot
# start a policies.yaml rule id, so their counters never mix with a file rule's.
OWN_RULE_IDS = {"key": "@api-key", "tenant": "@api-tenant"}
SPEND_RULE_ID = "@spend"
UNLIMITED_USD = 1e300  # a spend counter's "limit": never reached, finite for the Redis scripts
MAX_CACHED_PLANS = 100_000
MAX_REQUEST_PLANS = 20_000  # plans with a request's own subjects: least recently used forgotten first
BUDGET_PERIODS: tuple[tuple[Period, str], ...] = (("day", "usd_per_day"), ("month", "usd_per_month"))
RUN_PERIODS: tuple[tuple[Period, str], ...] = (*BUDGET_PERIODS, ("run", "usd_per_run"))
TOKEN_DIMENSIONS = ("rpm", "rpd", "tpm", "tpd")
RUN_DIMENSIONS = (*TOKEN_DIMENSIONS, *RUN_LIMITS)
RUN_HEADER_RULE_ID = "@run-header"  # a run budget the request's header set where no rule sets one
# A run's clock is one counter whichever rule caps it (its start is the run's, not a rule's): the
# tightest applicable cap is checked against it, and a reload that changes the rule keeps the start.
RUN_CLOCK_ID = "@run-clock"


def _spend_trackers(key_id: str, budgets: list[BudgetSpec]) -> list[BudgetSpec]:
    """Shadow day and month counters of the key's spend, for the periods no key budget counts yet."""
    counted = {b.period for b in budgets if b.scope == "key" and b.subject == key_id}
    return [
        BudgetSpec(f"{SPEND_RULE_ID}|{field}|{key_id}", SPEND_RULE_ID, "key", key_id, period, UNLIMITED_USD, True)
        for period, field in BUDGET_PERIODS
        if period not in counted
    ]


def price_of(model: ModelConfig | None) -> Price:
    """A model's price tables in USD per token (divided once here, never per request)."""
    if model is None:
        return Price()
    return price_table(model.price)


def pool_prices_of(model: ModelConfig | None) -> tuple[tuple[str, Price], ...]:
    """The pools with a price of their own for `model` (`pool_prices`), each compiled like `price_of`."""
    if model is None:
        return ()
    return tuple((pool, price_table(p)) for pool, p in model.pool_prices.items())


def price_table(p: PoolPriceConfig) -> Price:
    """One price (base table and its long-context tier) in USD per token."""
    long = p.long_context
    if long is None:
        return _table(p)
    return _table(p, long=_table(long), long_above_tokens=long.above_prompt_tokens)


def _table(p: TierPriceConfig, *, long: Price | None = None, long_above_tokens: int = 0) -> Price:
    cached = p.cached_input_per_mtok if p.cached_input_per_mtok is not None else p.input_per_mtok
    return Price(
        p.input_per_mtok / 1e6,
        cached / 1e6,
        p.output_per_mtok / 1e6,
        cache_write_usd=_per_token(p.cache_write_per_mtok),
        cache_write_1h_usd=_per_token(p.cache_write_1h_per_mtok),
        reasoning_usd=_per_token(p.reasoning_per_mtok),
        long=long,
        long_above_tokens=long_above_tokens,
    )


def _per_token(per_mtok: float | None) -> float | None:
    return None if per_mtok is None else per_mtok / 1e6


def settings_of(config: PoliciesConfig) -> StoreSettings:
    a = config.admission
    return StoreSettings(
        fail_open=a.store_failure == "fail_open",
        replicas=a.replicas,
        lease_ttl_s=a.lease_ttl_s,
        concurrency_retry_after_s=a.concurrency_retry_after_s,
        local_precheck=a.local_precheck,
        breaker_failures=a.breaker.failure_threshold,
        breaker_open_s=a.breaker.open_s,
    )


def _weights(rule: LimitConfig) -> tuple[float, float, float]:
    if rule.count == "input":
        return 1.0, 1.0, 0.0
    if rule.count == "output":
        return 0.0, 0.0, 1.0
    if rule.count == "weighted" and rule.weights is not None:
        w = rule.weights
        return w.input, (w.cached_input if w.cached_input is not None else w.input), w.output
    return 1.0, 1.0, 1.0


# What a match on one field implies: a key has one tenant, a tenant one team, a team one organisation.
_IMPLIES = {"key": {"tenant", "team", "org"}, "tenant": {"team", "org"}, "team": {"org"}}


def _covers(a: set[str], b: set[str]) -> bool:
    """Does a match on fields `a` imply one on `b`? A key implies its tenant, team and organisation."""
    return all(f in a or any(f in _IMPLIES.get(g, ()) for g in a) for f in b)


def _narrower(a: set[str], b: set[str]) -> bool:
    """Is a rule matching on `a` strictly more specific than one matching on `b` (both matching)?"""
    return _covers(a, b) and not _covers(b, a)


def _subject(scope: str, subject: dict[str, str | None]) -> str | None:
    """Who shares a rule's counters in `scope` (None: the request has no such subject)."""
    if scope == "key_model":
        return f"{subject['key']}/{subject['model']}"
    if scope == "team_provider":
        team, provider = subject["team"], subject["provider"]
        return None if team is None or provider is None else f"{team}/{provider}"
    if scope == "global":
        return "*"
    if scope in ("user", "program"):  # client-named: per tenant, two tenants' `alice` are two people
        named = subject[scope]
        return None if named is None else f"{subject['tenant']}/{named}"
    return subject[scope]


@dataclass(slots=True)
class _Specs:
    buckets: list[BucketSpec] = field(default_factory=list)
    leases: list[LeaseSpec] = field(default_factory=list)
    budgets: list[BudgetSpec] = field(default_factory=list)


class LimitIndex:
    def __init__(self, config: PoliciesConfig) -> None:
        self._config = config
        self._settings = settings_of(config)
        self._limits = {s: [r for r in config.limits if r.scope == s] for s in ALL_SCOPES}
        self._budgets = {s: [r for r in config.budgets if r.scope == s] for s in ALL_SCOPES}
        # request scopes with at least one rule: a request naming only others costs one look-up
        self._request_scopes = {s for s in REQUEST_SCOPES if self._limits[s] or self._budgets[s]}
        self._request_plans: OrderedDict[tuple[object, ...], Plan] = OrderedDict()
        # rule -> its match and identity with model aliases resolved, computed once
        self._matches: dict[int, dict[str, str]] = {}
        self._identities: dict[int, str] = {}
        self._fallbacks: dict[int, str] = {}  # rule -> its own fallback model, alias resolved
        for rule in [*config.limits, *config.budgets]:
            fields = rule.match.fields()
            if "model" in fields:
                fields["model"] = config.resolve_model(fields["model"])
            self._matches[id(rule)] = fields
            self._identities[id(rule)] = rule.identity(config.resolve_model)
            if rule.fallback is not None:
                self._fallbacks[id(rule)] = config.resolve_model(rule.fallback)
        # budget -> its billing period's store name, the zone's UTC offset taken once, at load
        self._billing = {id(b): b.billing.period() for b in config.budgets if b.billing is not None}
        self._plans: dict[tuple[str, str, int], Plan] = {}
        self._track_all_keys = config.admission.track_key_spend
        # temporary overrides (the admin API's, policies/keys): (rule, dimension) -> [(subject or None, value)]
        self._overrides_source: OverrideSource | None = None
        self._overrides_generation = -1
        self._override_values: dict[tuple[str, str], list[tuple[str | None, float]]] = {}
        self._overrides_end_s = math.inf  # the first active override's end: plans are rebuilt then

    def follow_overrides(self, source: OverrideSource) -> None:
        """Apply the temporary overrides `source` holds (the key directory), now and as they change or end."""
        self._overrides_source = source

    def _check_overrides(self) -> None:
        """Rebuild the plans when an override was added or deleted, or one ended: one attribute read
        per request, and a clock read only while an override is active."""
        source = self._overrides_source
        if source is None:
            return
        ended = self._overrides_end_s != math.inf and time.time() >= self._overrides_end_s
        if source.overrides_generation == self._overrides_generation and not ended:
            return
        self._overrides_generation = source.overrides_generation
        now_s = time.time()
        values: dict[tuple[str, str], list[tuple[str | None, float]]] = {}
        end_s = math.inf
        for override in source.overrides.values():
            if override.until_unix_s > now_s:
                values.setdefault((override.rule, override.dimension), []).append((override.subject, override.value))
                end_s = min(end_s, override.until_unix_s)
        self._override_values, self._overrides_end_s = values, end_s
        self._plans.clear()
        self._request_plans.clear()

    def _value(self, identity: str, dimension: str, who: str, value: float) -> float:
        """The rule's value for `who`, or an active override's (one naming the subject wins over one for all)."""
        found = self._override_values.get((identity, dimension))
        if not found:
            return value
        general = None
        for subject, override in found:
            if subject == who:
                return override
            if subject is None:
                general = override
        return value if general is None else general

    @property
    def settings(self) -> StoreSettings:
        return self._settings

    def plan(self, principal: Principal, model: str) -> Plan:
        self._check_overrides()
        cache_key = (principal.key_id, model, principal.revision)
        plan = self._plans.get(cache_key)
        if plan is None:
            plan = self._build(principal, model)
            if model in self._config.models:  # unknown names must not grow the cache
                if len(self._plans) >= MAX_CACHED_PLANS:  # API keys re-revised many times: start over
                    self._plans.clear()
                self._plans[cache_key] = plan
        return plan

    def _applicable(self, rules: Sequence[Rule], subject: dict[str, str | None], dimension: str) -> list[Rule]:
        """Matching rules that set `dimension`, less those another matching rule is more specific than."""
        matching = [
            rule
            for rule in rules
            if getattr(rule, dimension) is not None and all(subject[k] == v for k, v in self._matches[id(rule)].items())
        ]
        fields = [set(self._matches[id(rule)]) for rule in matching]
        return [
            rule
            for i, rule in enumerate(matching)
            if not any(_narrower(fields[j], fields[i]) for j in range(len(matching)) if j != i)
        ]

    def request_plan(self, principal: Principal, model: str, subjects: RequestSubjects) -> Plan:
        """The plan of (key, model) with the rules of the request's own subjects (user, tags, program)
        added; the (key, model) plan itself when no rule counts any of them. Cached by subjects,
        least recently used forgotten first, so an agent run's calls share one plan and its encoding."""
        plan = self.plan(principal, model)
        wanted = self._request_scopes
        asked = subjects.run_usd is not None or subjects.run_s is not None  # the run's own headers
        if (not wanted and not asked) or not subjects:  # the cheaper test first: no rule counts a subject
            return plan
        if not asked and not (
            (subjects.user is not None and "user" in wanted)
            or (subjects.tags and "tag" in wanted)
            or (subjects.program is not None and "program" in wanted)
        ):
            return plan
        cache_key = (principal.key_id, model, principal.revision, subjects)
        found = self._request_plans.get(cache_key)
        if found is not None:
            self._request_plans.move_to_end(cache_key)
            return found
        found = self._extend(plan, principal, model, subjects)
        if model in self._config.models:
            if len(self._request_plans) >= MAX_REQUEST_PLANS:
                self._request_plans.popitem(last=False)
            self._request_plans[cache_key] = found
        return found

    def _extend(self, plan: Plan, principal: Principal, model: str, subjects: RequestSubjects) -> Plan:
        subject = self._subject_of(principal, model)
        subject["user"], subject["program"] = subjects.user, subjects.program
        out = _Specs()
        if subjects.user is not None:
            self._scope_specs("user", subject, None, out)
        for tag in subjects.tags:
            self._scope_specs("tag", {**subject, "tag": tag}, None, out)
        if subjects.program is not None:
            self._scope_specs("program", subject, None, out)
            if subjects.run_usd is not None:
                _cap_run_budget(out.budgets, subjects.run_usd, _subject("program", subject) or "")
            if subjects.run_s is not None:
                _cap_run_clock(out.buckets, subjects.run_s, _subject("program", subject) or "")
        counts_run = (
            any(b.scope == "program" for b in out.buckets)
            or any(lease.scope == "program" for lease in out.leases)
            or any(b.scope == "program" for b in out.budgets)
        )
        program = subjects.program
        run = RunRef(principal.tenant, program, principal.key_id) if counts_run and program is not None else None
        return replace(
            plan,
            buckets=plan.buckets + tuple(out.buckets),
            leases=plan.leases + tuple(out.leases),
            budgets=plan.budgets + tuple(out.budgets),
            run=run,
            encoded={},
        )

    def _subject_of(self, principal: Principal, model: str) -> dict[str, str | None]:
        team = principal.team
        model_config = self._config.models.get(model)
        return {
            "key": principal.key_id,
            "tenant": principal.tenant,
            "team": team,
            "org": self._config.org_of(team),
            "model": model,
            "provider": model_config.provider if model_config is not None else None,
        }

    def _build(self, principal: Principal, model: str) -> Plan:
        subject = self._subject_of(principal, model)
        own = {"key": principal.key_limits, "tenant": principal.tenant_limits}
        out = _Specs()
        for scope in SCOPES:
            self._scope_specs(scope, subject, own.get(scope), out)
        if principal.track_spend or self._track_all_keys:
            out.budgets += _spend_trackers(principal.key_id, out.budgets)
        model_config = self._config.models.get(model)
        return Plan(
            model=model,
            buckets=tuple(out.buckets),
            leases=tuple(out.leases),
            budgets=tuple(out.budgets),
            price=price_of(model_config),
            pool_prices=pool_prices_of(model_config),
            default_max_tokens=model_config.default_max_tokens if model_config else 1024,
            settings=self._settings,
        )

    def _run_clock(self, subject: dict[str, str | None], who: str) -> BucketSpec | None:
        """The run's wall-clock cap: the smallest enforced `seconds_per_run` of the applicable rules
        (several can apply when none is more specific), else the smallest shadow one, on the run's
        one clock (`RUN_CLOCK_ID`)."""
        best: tuple[bool, float, LimitConfig] | None = None
        for rule in self._applicable(self._limits["program"], subject, "seconds_per_run"):
            identity = self._identities[id(rule)]
            cap = self._value(identity, "seconds_per_run", who, float(rule.seconds_per_run or 0.0))
            if best is None or (rule.shadow, cap) < best[:2]:
                best = (rule.shadow, cap, rule)
        if best is None:
            return None
        _, cap, rule = best
        return BucketSpec(
            key=f"{RUN_CLOCK_ID}|seconds_per_run|{who}",
            rule_id=self._identities[id(rule)],
            scope="program",
            subject=who,
            dimension="seconds_per_run",
            kind="seconds",
            capacity=cap,
            window_s=math.inf,
            rate_per_s=CLOCK_RATE_PER_S,
            shadow=rule.shadow,
            fallback=self._fallbacks.get(id(rule)),
        )

    def _scope_specs(self, scope: str, subject: dict[str, str | None], mine: OwnLimits | None, out: _Specs) -> None:
        """The buckets, leases and budgets of one scope's rules that apply to `subject`: a key's (tenant's)
        own limits first (the most specific rule there is), else the most specific matching rules."""
        who = _subject(scope, subject)
        if who is None:
            return
        own_id = OWN_RULE_IDS.get(scope, "")
        run = scope == "program"
        for dimension in RUN_DIMENSIONS if run else TOKEN_DIMENSIONS:
            window_s = DIMENSION_WINDOW_S[dimension]
            kind = DIMENSION_KIND[dimension]
            value = mine.value(dimension) if mine is not None else None
            if value is not None:
                key = f"{own_id}|{dimension}|{who}"
                out.buckets.append(
                    BucketSpec(key, own_id, scope, who, dimension, kind, value, window_s, value / window_s, False)
                )
                continue
            if kind == "seconds":
                clock = self._run_clock(subject, who)
                if clock is not None:
                    out.buckets.append(clock)
                continue
            for rule in self._applicable(self._limits[scope], subject, dimension):
                identity = self._identities[id(rule)]
                capacity = self._value(identity, dimension, who, float(getattr(rule, dimension)))
                w_in, w_cached, w_out = _weights(rule) if kind == "tokens" else (1.0, 1.0, 1.0)
                out.buckets.append(
                    BucketSpec(
                        key=f"{identity}|{dimension}|{who}",
                        rule_id=identity,
                        scope=scope,
                        subject=who,
                        dimension=dimension,
                        kind=kind,
                        capacity=capacity,
                        window_s=window_s,
                        rate_per_s=capacity / window_s,  # 0 for a run's caps: they never refill
                        shadow=rule.shadow,
                        w_input=w_in,
                        w_cached=w_cached,
                        w_output=w_out,
                        fallback=self._fallbacks.get(id(rule)),
                    )
                )
        own_concurrent = mine.max_concurrent if mine is not None else None
        if own_concurrent is not None:
            out.leases.append(LeaseSpec(f"{own_id}|max_concurrent|{who}", own_id, scope, who, own_concurrent, False))
        else:
            for limit in self._applicable(self._limits[scope], subject, "max_concurrent"):
                identity = self._identities[id(limit)]
                key = f"{identity}|max_concurrent|{who}"
                out.leases.append(
                    LeaseSpec(
                        key,
                        identity,
                        scope,
                        who,
                        int(self._value(identity, "max_concurrent", who, float(limit.max_concurrent or 0))),
                        limit.shadow,
                        self._fallbacks.get(id(limit)),
                    )
                )
        for period, budget_field in RUN_PERIODS if run else BUDGET_PERIODS:
            own_usd = mine.value(budget_field) if mine is not None else None
            if own_usd is not None:
                key = f"{own_id}|{budget_field}|{who}"
                out.budgets.append(BudgetSpec(key, own_id, scope, who, period, own_usd, False))
                continue
            for budget in self._applicable(self._budgets[scope], subject, budget_field):
                identity = self._identities[id(budget)]
                limit_usd = self._value(identity, budget_field, who, float(getattr(budget, budget_field)))
                key = f"{identity}|{budget_field}|{who}"
                out.budgets.append(
                    BudgetSpec(
                        key, identity, scope, who, period, limit_usd, budget.shadow, self._fallbacks.get(id(budget))
                    )
                )
        for budget in self._applicable(self._budgets[scope], subject, "usd_per_period"):
            identity = self._identities[id(budget)]
            out.budgets.append(
                BudgetSpec(
                    f"{identity}|usd_per_period|{who}",
                    identity,
                    scope,
                    who,
                    self._billing[id(budget)],
                    self._value(identity, "usd_per_period", who, float(budget.usd_per_period or 0.0)),
                    budget.shadow,
                    self._fallbacks.get(id(budget)),
                )
            )


def _cap_run_budget(budgets: list[BudgetSpec], run_usd: float, who: str) -> None:
    """The request's run budget header lowers the policy's per-run budget, never raises it; where no
    rule sets one, it sets its own (a client may always spend less)."""
    runs = [i for i, b in enumerate(budgets) if b.period == "run" and not b.shadow]
    for i in runs:
        if run_usd < budgets[i].limit_usd:
            budgets[i] = replace(budgets[i], limit_usd=run_usd)
    if not runs:
        key = f"{RUN_HEADER_RULE_ID}|usd_per_run|{who}"
        budgets.append(BudgetSpec(key, RUN_HEADER_RULE_ID, "program", who, "run", run_usd, False))


def _cap_run_clock(specs: list[BucketSpec], run_s: float, who: str) -> None:
    """The request's wall-clock header lowers the policy's `seconds_per_run`, never raises it; where no
    rule enforces one, it sets its own on the run's clock (a client may always stop sooner)."""
    for i, spec in enumerate(specs):
        if spec.kind != "seconds":
            continue
        if spec.shadow:  # the run's one clock: the header's cap is enforced on it, the shadow rule yields
            specs[i] = replace(spec, rule_id=RUN_HEADER_RULE_ID, capacity=run_s, shadow=False, fallback=None)
        elif run_s < spec.capacity:
            specs[i] = replace(spec, capacity=run_s)
        return
    key = f"{RUN_CLOCK_ID}|seconds_per_run|{who}"
    specs.append(
        BucketSpec(key, RUN_HEADER_RULE_ID, "program", who, "seconds_per_run", "seconds", run_s, math.inf,
                   CLOCK_RATE_PER_S, False)
    )  # fmt: skip

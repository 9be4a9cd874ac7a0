"""Limits and budgets of policies.yaml compiled into the `Plan` of each (key, model).

Resolution, per scope and per dimension: of the rules of that scope whose `match` fits the request's
(key, tenant, model) and that set the dimension, a rule applies unless another one is strictly more
specific (its match implies this one's; a key implies its tenant). So a rule for key `demo` overrides
the rule for every key of tenant `free`, which overrides the rule for every key, while `key_model`
rules for "key k1" and for "model big" both apply to k1 on big, each with its own bucket. Different
scopes always stack.

Plans are built on first use and cached for the life of the policy object, so a request costs one
dictionary lookup; a reload builds a new policy and therefore new plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from policies.limits.types import (
    DIMENSION_KIND,
    DIMENSION_WINDOW_S,
    BucketSpec,
    BudgetSpec,
    LeaseSpec,
    Period,
    Plan,
    Price,
    StoreSettings,
)
from policies.schema import BudgetConfig, LimitConfig, ModelConfig, PoliciesConfig, TierPriceConfig
from policies.types import Principal

Rule = TypeVar("Rule", LimitConfig, BudgetConfig)

SCOPES = ("key", "tenant", "model", "key_model", "global")
# Rule identities of limits set through the admin API and of the key spend counters: '@' cannot
# start a policies.yaml rule id, so their counters never mix with a file rule's.
OWN_RULE_IDS = {"key": "@api-key", "tenant": "@api-tenant"}
SPEND_RULE_ID = "@spend"
UNLIMITED_USD = 1e300  # a spend counter's "limit": never reached, finite for the Redis scripts
MAX_CACHED_PLANS = 100_000
BUDGET_PERIODS: tuple[tuple[Period, str], ...] = (("day", "usd_per_day"), ("month", "usd_per_month"))
TOKEN_DIMENSIONS = ("rpm", "rpd", "tpm", "tpd")


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
    p = model.price
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


def _covers(a: set[str], b: set[str]) -> bool:
    """Does a match on fields `a` imply one on `b`? A key implies its tenant."""
    return all(f in a or (f == "tenant" and "key" in a) for f in b)


def _narrower(a: set[str], b: set[str]) -> bool:
    """Is a rule matching on `a` strictly more specific than one matching on `b` (both matching)?"""
    return _covers(a, b) and not _covers(b, a)


def _subject(scope: str, key_id: str, tenant: str, model: str) -> str:
    if scope == "key":
        return key_id
    if scope == "tenant":
        return tenant
    if scope == "model":
        return model
    if scope == "key_model":
        return f"{key_id}/{model}"
    return "*"


class LimitIndex:
    def __init__(self, config: PoliciesConfig) -> None:
        self._config = config
        self._settings = settings_of(config)
        self._limits = {s: [r for r in config.limits if r.scope == s] for s in SCOPES}
        self._budgets = {s: [r for r in config.budgets if r.scope == s] for s in SCOPES}
        # rule -> its match and identity with model aliases resolved, computed once
        self._matches: dict[int, dict[str, str]] = {}
        self._identities: dict[int, str] = {}
        for rule in [*config.limits, *config.budgets]:
            fields = rule.match.fields()
            if "model" in fields:
                fields["model"] = config.resolve_model(fields["model"])
            self._matches[id(rule)] = fields
            self._identities[id(rule)] = rule.identity(config.resolve_model)
        self._plans: dict[tuple[str, str, int], Plan] = {}
        self._track_all_keys = config.admission.track_key_spend

    @property
    def settings(self) -> StoreSettings:
        return self._settings

    def plan(self, principal: Principal, model: str) -> Plan:
        cache_key = (principal.key_id, model, principal.revision)
        plan = self._plans.get(cache_key)
        if plan is None:
            plan = self._build(principal, model)
            if model in self._config.models:  # unknown names must not grow the cache
                if len(self._plans) >= MAX_CACHED_PLANS:  # API keys re-revised many times: start over
                    self._plans.clear()
                self._plans[cache_key] = plan
        return plan

    def _applicable(self, rules: Sequence[Rule], subject: dict[str, str], dimension: str) -> list[Rule]:
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

    def _build(self, principal: Principal, model: str) -> Plan:
        key_id, tenant = principal.key_id, principal.tenant
        subject = {"key": key_id, "tenant": tenant, "model": model}
        own = {"key": principal.key_limits, "tenant": principal.tenant_limits}
        bucket_specs: list[BucketSpec] = []
        lease_specs: list[LeaseSpec] = []
        budget_specs: list[BudgetSpec] = []
        for scope in SCOPES:
            who = _subject(scope, key_id, tenant, model)
            mine = own.get(scope)
            own_id = OWN_RULE_IDS.get(scope, "")
            for dimension in TOKEN_DIMENSIONS:
                window_s = DIMENSION_WINDOW_S[dimension]
                kind = DIMENSION_KIND[dimension]
                value = mine.value(dimension) if mine is not None else None
                if value is not None:  # the key's (tenant's) own: the most specific rule there is
                    key = f"{own_id}|{dimension}|{who}"
                    bucket_specs.append(
                        BucketSpec(key, own_id, scope, who, dimension, kind, value, window_s, value / window_s, False)
                    )
                    continue
                for rule in self._applicable(self._limits[scope], subject, dimension):
                    capacity = float(getattr(rule, dimension))
                    w_in, w_cached, w_out = _weights(rule) if kind == "tokens" else (1.0, 1.0, 1.0)
                    identity = self._identities[id(rule)]
                    bucket_specs.append(
                        BucketSpec(
                            key=f"{identity}|{dimension}|{who}",
                            rule_id=identity,
                            scope=scope,
                            subject=who,
                            dimension=dimension,
                            kind=kind,
                            capacity=capacity,
                            window_s=window_s,
                            rate_per_s=capacity / window_s,
                            shadow=rule.shadow,
                            w_input=w_in,
                            w_cached=w_cached,
                            w_output=w_out,
                        )
                    )
            own_concurrent = mine.max_concurrent if mine is not None else None
            if own_concurrent is not None:
                lease_specs.append(
                    LeaseSpec(f"{own_id}|max_concurrent|{who}", own_id, scope, who, own_concurrent, False)
                )
            else:
                for limit in self._applicable(self._limits[scope], subject, "max_concurrent"):
                    identity = self._identities[id(limit)]
                    key = f"{identity}|max_concurrent|{who}"
                    lease_specs.append(LeaseSpec(key, identity, scope, who, limit.max_concurrent or 0, limit.shadow))
            for period, field in BUDGET_PERIODS:
                own_usd = mine.value(field) if mine is not None else None
                if own_usd is not None:
                    key = f"{own_id}|{field}|{who}"
                    budget_specs.append(BudgetSpec(key, own_id, scope, who, period, own_usd, False))
                    continue
                for budget in self._applicable(self._budgets[scope], subject, field):
                    identity = self._identities[id(budget)]
                    limit_usd = float(getattr(budget, field))
                    key = f"{identity}|{field}|{who}"
                    budget_specs.append(BudgetSpec(key, identity, scope, who, period, limit_usd, budget.shadow))
        if principal.track_spend or self._track_all_keys:
            budget_specs += _spend_trackers(key_id, budget_specs)
        model_config = self._config.models.get(model)
        return Plan(
            model=model,
            buckets=tuple(bucket_specs),
            leases=tuple(lease_specs),
            budgets=tuple(budget_specs),
            price=price_of(model_config),
            default_max_tokens=model_config.default_max_tokens if model_config else 1024,
            settings=self._settings,
        )

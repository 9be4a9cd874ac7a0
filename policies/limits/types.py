"""Vocabulary of admission: what applies to one (key, model), and what a store reports back.

A `Plan` is compiled once per (key, model) and policy version and reused by every request; only the
per-request amounts (`Charge`) are computed on the hot path. Store keys carry the rule's identity,
the dimension and the subject, never a list position, so counters survive reloads that keep the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["requests", "tokens"]
Period = Literal["day", "month"]

DIMENSION_WINDOW_S: dict[str, float] = {"rpm": 60.0, "rpd": 86_400.0, "tpm": 60.0, "tpd": 86_400.0}
DIMENSION_KIND: dict[str, Kind] = {"rpm": "requests", "rpd": "requests", "tpm": "tokens", "tpd": "tokens"}
DIMENSION_LABEL: dict[str, str] = {
    "rpm": "requests per min (RPM)",
    "rpd": "requests per day (RPD)",
    "tpm": "tokens per min (TPM)",
    "tpd": "tokens per day (TPD)",
    "max_concurrent": "concurrent requests",
}


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One continuous-refill bucket: `capacity` per `window_s`, refilled at `rate_per_s`.

    Token buckets count `w_input * uncached prompt + w_cached * cached prompt + w_output * output`;
    request buckets count 1 per request (weights unused).
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

    def reserve_cost(self, prompt_tokens: int, output_tokens: int) -> float:
        """Conservative: no prompt token is assumed cached before the call."""
        if self.kind == "requests":
            return 1.0
        return self.w_input * prompt_tokens + self.w_output * output_tokens

    def actual_cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        if self.kind == "requests":
            return 1.0
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


@dataclass(frozen=True, slots=True)
class Price:
    """USD per token (the config's per-million prices, divided once)."""

    input_usd: float = 0.0
    cached_input_usd: float = 0.0
    output_usd: float = 0.0

    def cost_usd(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        cached = min(cached_tokens, prompt_tokens)
        return (
            (prompt_tokens - cached) * self.input_usd
            + cached * self.cached_input_usd
            + completion_tokens * self.output_usd
        )


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
class Plan:
    """Everything that applies to one (key, model): compiled once, shared by its requests."""

    model: str
    buckets: tuple[BucketSpec, ...]
    leases: tuple[LeaseSpec, ...]
    budgets: tuple[BudgetSpec, ...]
    price: Price
    default_max_tokens: int
    settings: StoreSettings
    # A store's precomputed encoding of this plan (Redis keys and script arguments), filled on first
    # use so the hot path only formats the per-request amounts.
    encoded: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)


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

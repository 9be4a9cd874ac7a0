"""Vocabulary of admission: what applies to one (key, model), and what a store reports back.

A `Plan` is compiled once per (key, model) and policy version and reused by every request; only the
per-request amounts (`Charge`) are computed on the hot path. Store keys carry the rule's identity,
the dimension and the subject, never a list position, so counters survive reloads that keep the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

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
# rate is all it takes: `buckets.drained` and preamble.lua's `drained` need no special case, and the
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
        p = self.tier(prompt_tokens)
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
    """The agent run a plan counts (policies/limits/runs.py): its admitted calls also note it in the
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

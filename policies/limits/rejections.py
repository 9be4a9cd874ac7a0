"""The admission's "no" in the terms of the error catalogue (README, "Errors"), worded like OpenAI's own
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

import math
from datetime import UTC, datetime

from policies.limits.types import DIMENSION_LABEL, BucketSpec, BudgetSpec, LeaseSpec
from policies.types import Rejection

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

"""Vocabulary of the policies room: who is calling, the facts of one request that decisions read, and times
as people type them.

Times live here because a key's expiry (a `KeyRecord`'s) and a usage report's window read the same
forms, and neither owns the other.

Callers and requests
--------------------

Vocabulary of the policies room: who is calling, and the facts of one request that decisions read.

Times as people type them
-------------------------

Times as people type them: durations (`90s`, `30m`, `24h`, `7d`, `2w`) and ISO-8601 times or
dates, in seconds. A key's expiry in the admin API and a usage report's window read the same forms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # policies.slo imports the predictor room; the facts only carry its value
    from policies.slo import Slo
import re
from datetime import UTC, datetime

from backends.types import usage_count

ApiKind = Literal["chat", "completions", "embeddings", "responses", "messages"]


@dataclass(frozen=True, slots=True)
class OwnLimits:
    """Limits and budgets set on one key or tenant made through the admin API (not policies.yaml).

    Each set value is the most specific rule of its scope and dimension, so it overrides the file's
    rules for every key (or tenant) of that dimension; unset values leave the file's rules in force."""

    rpm: int | None = None
    rpd: int | None = None
    tpm: int | None = None
    tpd: int | None = None
    max_concurrent: int | None = None
    usd_per_day: float | None = None
    usd_per_month: float | None = None

    def value(self, dimension: str) -> float | None:
        found = getattr(self, dimension, None)
        return None if found is None else float(found)


@dataclass(frozen=True, slots=True)
class RequestSubjects:
    """What a request names beside its key (gateway/request/intake.py reads them, bounded): its end
    user, its tags, its agent program, and the run budget and wall-clock cap its headers ask for (within
    the policy's)."""

    user: str | None = None
    tags: tuple[str, ...] = ()
    program: str | None = None
    run_usd: float | None = None
    run_s: float | None = None

    def __bool__(self) -> bool:
        return self.user is not None or bool(self.tags) or self.program is not None


NO_SUBJECTS = RequestSubjects()


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller: one API key of one tenant.

    Keys made through the admin API carry their own and their tenant's limits (`key_limits`,
    `tenant_limits`); `revision` changes whenever those do, so compiled admission plans of the old
    ones are never reused. `track_spend` adds day and month spend counters for the key (never
    enforced) where no budget of its own counts them, so the key's standing can report spend."""

    key_id: str
    tenant: str
    allowed_models: frozenset[str] | None  # None = every model
    priority: int  # higher runs first; < 0 is sheddable
    allow_fallback: bool = True
    key_limits: OwnLimits | None = None
    tenant_limits: OwnLimits | None = None
    revision: int = 0
    track_spend: bool = False
    slo_class: str | None = None  # an API-made tenant's SLO class (file tenants': policy.slo_class)
    source: str = "file"  # file | api
    show_cost: bool = False  # answers carry `usage.cost_usd` (its tenant's or key's `show_cost`)
    team: str | None = None  # its tenant's team (policies.yaml `teams`); the team's org follows from it

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


@dataclass(slots=True)
class RequestFacts:
    """What the gateway knows about one request before it runs; built once by the gateway's intake,
    read by every decision, never changed (what routing learns per request travels in
    `policies.routing.types.RouteRequest`, what it decided in `RouteDecision`).

    Not a frozen dataclass, though nothing changes it: a frozen one's `__init__` sets each of its
    twenty fields through `object.__setattr__`, several microseconds per request, and it could never
    be hashed anyway (`body` is a dict). `dataclasses.replace` makes a changed copy, as before.

    `body` is the client's parsed JSON (the one parse of the request); forwarding copies it shallowly.
    `model` is the public model after alias resolution; `requested_model` is what the client sent.
    `output_reservation` is `policies.estimate.output_reservation` for `model`.
    """

    request_id: str
    api: ApiKind
    body: dict[str, Any]
    requested_model: str
    model: str
    principal: Principal
    stream: bool = False
    include_usage: bool = False  # the client asked for stream usage itself
    prompt_tokens: int = 0
    prompt_token_ids: Sequence[int] | None = None  # when counted locally (chat/completions): array('I')
    prompt_tokens_source: str = ""  # model | engine | sim | estimate (policies/estimate.py); "" unknown
    max_tokens: int | None = None
    output_reservation: int = 0
    session_key: str | None = None
    cache_salt: str | None = None
    allow_fallback: bool = True  # tenant policy and the per-request opt-out combined
    debug: bool = False
    batch_id: str | None = None  # a line of this batch (Batch API): lowest priority, the batch price
    slo: Slo | None = None  # the effective latency SLO: the caller's class tightened by its headers
    subjects: RequestSubjects = NO_SUBJECTS  # end user, tags, agent program: their own limits and budgets

    @property
    def slo_ttft_ms(self) -> float | None:
        return self.slo.ttft_ms if self.slo is not None else None

    @property
    def slo_tpot_ms(self) -> float | None:
        return self.slo.tpot_ms if self.slo is not None else None


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens a finished request used, as the engine reported them (or as counted if it broke)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache
    # hosted providers bill these apart (backends/hosted/base.ProviderUsage): prompt tokens written to
    # the provider's cache (default lifetime, one hour) and output tokens spent reasoning
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_chat(cls, obj: Any) -> Usage | None:
        """A chat-completions `usage` object (parsed JSON), tokenway's cache-write detail keys included
        (`prompt_tokens_details.cache_write_tokens` / `cache_write_1h_tokens`, as the hosted transport
        writes them); None when it is not an object."""
        if type(obj) is not dict:
            return None
        details = obj.get("prompt_tokens_details")
        out = obj.get("completion_tokens_details")
        cached = write = write_1h = reasoning = 0
        if type(details) is dict:
            cached = usage_count(details.get("cached_tokens"))
            write = usage_count(details.get("cache_write_tokens"))
            write_1h = usage_count(details.get("cache_write_1h_tokens"))
        if type(out) is dict:
            reasoning = usage_count(out.get("reasoning_tokens"))
        return cls(
            usage_count(obj.get("prompt_tokens")),
            usage_count(obj.get("completion_tokens")),
            cached,
            write,
            write_1h,
            reasoning,
        )


@dataclass(frozen=True, slots=True)
class Rejection:
    """A decision's "no", in the terms of the error catalogue (README, "Errors"); the gateway renders it.

    `type`/`code` follow OpenAI's error shape; `headers` carry retry-after, x-ratelimit-*, and
    x-should-retry as the catalogue prescribes.
    """

    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    reason: str = ""  # short machine label for metrics: rate_limited, budget_exhausted, slo_unattainable...
    fallback_model: str | None = None  # the refusing rule's own fallback (policies.yaml `fallback`)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration_s(text: str) -> float:
    """'90s', '30m', '24h', '7d', '2w' -> seconds; ValueError when it is none of them."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (e.g. 30m, 24h, 7d)")
    return float(m[1]) * _UNIT_S[m[2]]


def parse_iso_s(text: str) -> float:
    """An ISO-8601 time or date (UTC when it names no offset) -> unix seconds; ValueError if it is not one."""
    moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()

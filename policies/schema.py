"""The schema of config/policies.yaml (pydantic: config only, never per request).

Tenants own keys; keys are stored as SHA-256 hex digests, never in clear. Models declare their
aliases, context length, price and fallback chain. `limits` and `budgets` are lists of rules, each at
one scope (key, tenant, model, key x model, global) and optionally narrowed by `match`; `admission`
says what the limiter does when its shared store is down.

Cross-references (a key's tenant, a limit's matched model, a fallback target) are checked together in
one validator, which raises `ReferenceErrors` listing every problem with its key path, so a file with
three mistakes is reported once, not three times.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.flow.room import FlowPolicy, ProgramFairness

PriorityName = Literal["critical", "high", "normal", "low", "sheddable"]
PRIORITY_VALUES: dict[str, int] = {"critical": 2, "high": 1, "normal": 0, "low": -1, "sheddable": -2}

Trigger = Literal[
    "rate_limited",
    "budget_exhausted",
    "upstream_error",
    "context_too_long",
    "slo_unattainable",
    "queue_timeout",
    "cold_start",
]
TRIGGERS: tuple[str, ...] = get_args(Trigger)
Scope = Literal[
    "key", "tenant", "team", "org", "model", "key_model", "team_provider", "global", "user", "tag", "program"
]
MissAction = Literal["fallback", "queue", "reject", "proceed"]
CountMode = Literal["input", "output", "total", "weighted"]

# Which `match` fields each scope accepts: a rule may narrow its subjects by the fields that identify
# them (a key belongs to a tenant, so `scope: key, match: {tenant: free}` = "each key of tenant free").
# An organisation holds teams, a team holds tenants (projects), a tenant holds keys: a rule for each
# key of team `search` is `scope: key, match: {team: search}`. End users, tags and agent programs
# (per-request subjects, docs/governance.md) narrow by who sends them.
_OWNERS = frozenset({"tenant", "team", "org"})
SCOPE_MATCH_FIELDS: dict[str, frozenset[str]] = {
    "key": frozenset({"key"}) | _OWNERS,
    "tenant": _OWNERS,
    "team": frozenset({"team", "org"}),
    "org": frozenset({"org"}),
    "model": frozenset({"model"}),
    "key_model": frozenset({"key", "model"}) | _OWNERS,
    "team_provider": frozenset({"team", "org", "provider"}),
    "global": frozenset(),
    "user": frozenset({"key", "model"}) | _OWNERS,
    "tag": frozenset({"tag", "key", "model"}) | _OWNERS,
    "program": frozenset({"key", "model"}) | _OWNERS,
}
# Scopes whose subject comes with each request rather than with the key (compiled per request).
REQUEST_SCOPES = frozenset({"user", "tag", "program"})
RUN_LIMITS = ("calls_per_run", "tokens_per_run", "seconds_per_run")

_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$"
# the request tags' own rule (`_tags` in gateway/request/intake.py)
_TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,63}$"


# Request fields that steer the engine itself (vLLM, TensorRT-LLM): clients may not set them unless their
# tenant's `engine_fields` names them (`policies.policy.client_body`, which drops the others).
ENGINE_CONTROL_FIELDS = frozenset(
    {
        "kv_transfer_params",  # vLLM / vllm-ascend PD handshake
        "ec_transfer_params",  # vLLM encoder-cache transfer
        "disaggregated_params",  # TensorRT-LLM PD handshake
        "priority",  # scheduler priority: from the tenant's tier
        "cache_salt",  # prefix-cache isolation
        "request_id",  # the engine's own id (collisions, log confusion)
        "session_id",
        "vllm_xargs",  # SamplingParams.extra_args
        "lora_request",  # TensorRT-LLM: an adapter by path
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReferenceErrors(ValueError):
    """Several cross-reference problems, each `(key path, message)`; the loader prints one per line."""

    def __init__(self, problems: list[tuple[tuple[str | int, ...], str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{format_path(p)}: {m}" for p, m in problems))


def format_path(path: tuple[str | int, ...]) -> str:
    """`("limits", 2, "tpm")` -> `limits[2].tpm`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


class TenantSpillConfig(_Strict):
    """A tenant's spill-over to a model's overflow pools (pools with `overflow: true`, docs/providers.md)."""

    allowed: bool = Field(default=True, description="its requests may go to overflow pools")
    usd_per_day: float | None = Field(
        default=None, ge=0, description="at most this much spent on overflow pools per UTC day; null: no cap"
    )


class SpillPolicy(_Strict):
    """When a request leaves the model's owned pools for an overflow pool (docs/providers.md, "Spill-over")."""

    max_wait_ms: float = Field(
        default=250.0, ge=0, description="a request that waited longer than this in an owned pool's room spills"
    )
    max_waiting: int | None = Field(
        default=None, ge=1, description="with this many waiting in an owned pool's room, arrivals spill at once"
    )
    usd_per_wait_second: float | None = Field(
        default=None,
        ge=0,
        description="what a second of a request's waiting is worth: it spills as soon as its predicted wait for "
        "an owned pool times this exceeds what the overflow pool costs it more (null: wait and crowding only)",
    )


class OrgConfig(_Strict):
    """An organisation: the top of the spend hierarchy (org -> team -> tenant -> key). Its limits and
    budgets are rules of `scope: org` (docs/governance.md)."""

    description: str | None = Field(default=None, max_length=256)


class TeamConfig(_Strict):
    """A team: the tenants (projects) that name it share its `scope: team` limits and budgets."""

    org: str | None = Field(default=None, description="the organisation it belongs to (orgs)")
    description: str | None = Field(default=None, max_length=256)


class TenantConfig(_Strict):
    team: str | None = Field(default=None, description="the team it belongs to (teams); null: none")
    models: list[str] | None = Field(default=None, description="allowed public models; null = all")
    priority: PriorityName = "normal"
    allow_fallback: bool = True
    slo_class: str | None = Field(default=None, description="latency SLO of its requests (slo_classes)")
    weight: float = Field(default=1.0, gt=0, description="its share of a saturated pool, relative to others'")
    engine_fields: list[str] = Field(
        default_factory=list,
        description="engine-control request fields its clients may set (policies/policy.py); none by default",
    )
    cache_group: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="tenants naming the same group share the engines' prefix cache; by default each tenant has its own",
    )
    spill: TenantSpillConfig = Field(
        default_factory=lambda: TenantSpillConfig(), description="whether its requests may spill to overflow pools"
    )
    program_max_repeats: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="runaway guard: an agent program may send the same last turn this many times in a row, the "
        "next is refused 429 `program_loop` (docs/agents.md); null = off",
    )
    program_max_cycle: int = Field(
        default=4,
        ge=1,
        le=16,
        description="runaway guard: loops of up to this many different turns (a cycle of tool calls) are counted "
        "too, each full round as one repeat; 1 = only the same turn again (docs/agents.md)",
    )
    show_cost: bool = Field(
        default=False,
        description="answers carry their cost in `usage.cost_usd` (streams: the final usage event; "
        "docs/governance.md); off keeps bodies exactly the API's own",
    )
    program_fairness: ProgramFairness | None = Field(
        default=None,
        description="program-fair queueing: inside its share, the program served least lately goes first "
        "(docs/agents.md); null = off (its waiting requests go in arrival order)",
    )

    @field_validator("engine_fields")
    @classmethod
    def _known_engine_fields(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - ENGINE_CONTROL_FIELDS)
        if unknown:
            raise ValueError(f"not engine-control fields: {unknown} (known: {sorted(ENGINE_CONTROL_FIELDS)})")
        return value


class KeyConfig(_Strict):
    id: str = Field(pattern=_ID_PATTERN)
    tenant: str
    sha256: str = Field(description="hex SHA-256 of the key; `tokenway keys create` prints it")
    models: list[str] | None = Field(default=None, description="narrows the tenant's models")
    priority: PriorityName | None = None
    disabled: bool = False
    show_cost: bool | None = Field(default=None, description="overrides its tenant's `show_cost`; null = the tenant's")

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        value = value.lower()
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("expected 64 hex characters (SHA-256 of the key)")
        return value


class TierPriceConfig(_Strict):
    """One price table, USD per million tokens (docs/providers.md, "Pricing"): a prompt token is a
    cache read, a cache write (default lifetime, or one hour) or plain input; an output token is
    output or reasoning (thinking)."""

    input_per_mtok: float = Field(default=0.0, ge=0)
    cached_input_per_mtok: float | None = Field(default=None, ge=0, description="cache reads; defaults to input")
    cache_write_per_mtok: float | None = Field(
        default=None,
        ge=0,
        description="cache writes at the provider's default lifetime (Anthropic: 5 min); defaults to input",
    )
    cache_write_1h_per_mtok: float | None = Field(
        default=None, ge=0, description="cache writes with a one-hour lifetime; defaults to cache_write"
    )
    output_per_mtok: float = Field(default=0.0, ge=0)
    reasoning_per_mtok: float | None = Field(
        default=None, ge=0, description="reasoning (thinking) output tokens; defaults to output"
    )


class LongContextPriceConfig(TierPriceConfig):
    """The table for a request whose prompt (cache reads and writes included) is over `above_prompt_tokens`:
    it prices the whole request, output included."""

    above_prompt_tokens: int = Field(ge=1, description="prompts longer than this pay the long-context table")


class PoolPriceConfig(TierPriceConfig):
    """A pool's own price for a model (`models.<m>.pool_prices.<pool>`), USD per million tokens: the
    same tables as the model's `price`, without `batch_factor` (a batch line pays the model's share of
    whichever pool's price applies)."""

    long_context: LongContextPriceConfig | None = Field(
        default=None, description="a dearer table for long prompts (Anthropic's 1M context, Gemini's over 200k)"
    )


class PriceConfig(PoolPriceConfig):
    """USD per million tokens."""

    batch_factor: float | None = Field(
        default=None, ge=0, le=1, description="batch lines pay this share of the price (default: batch.price_factor)"
    )


def _all_triggers() -> list[Trigger]:
    return list(TRIGGERS)  # type: ignore[arg-type]


class FallbackConfig(_Strict):
    """One step of a model's fallback chain and the triggers allowed to take it."""

    model: str
    triggers: list[Trigger] = Field(default_factory=lambda: _all_triggers(), min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _yaml_on(cls, value: Any) -> Any:
        if isinstance(value, dict) and True in value:
            raise ValueError("YAML reads `on:` as true; name the list `triggers:`")
        return value


class ModelConfig(_Strict):
    aliases: list[str] = Field(default_factory=list)
    context_length: int | None = Field(default=None, ge=1, description="prompt + max_tokens limit")
    default_max_tokens: int = Field(default=1024, ge=1, description="output reservation without max_tokens")
    price: PriceConfig = Field(default_factory=PriceConfig)
    pool_prices: dict[str, PoolPriceConfig] = Field(
        default_factory=dict,
        description="per gateway.yaml pool name: that pool's own price for this model (a hosted provider's, say); "
        'pools not named pay `price` (docs/providers.md, "Prices per pool")',
    )
    provider: str | None = Field(
        default=None,
        pattern=_ID_PATTERN,
        description="who serves it (`anthropic`, `bedrock`, `self-hosted`, ...): what `scope: team_provider` counts by",
    )
    fallbacks: list[FallbackConfig] = Field(default_factory=list, description="tried in order")
    stream_failover: bool = Field(
        default=False,
        description="a stream cut mid-answer continues on the next model of `fallbacks` (docs/agents.md)",
    )
    # LoRA adapters (docs/adapters.md): a model of `kind: adapter` runs on its `base` model's pools
    kind: Literal["model", "adapter"] = Field(
        default="model", description="`adapter`: a LoRA adapter served by the pools of `base`"
    )
    base: str | None = Field(default=None, description="adapter: the model it adapts (a model, not an adapter)")
    source: str | None = Field(
        default=None, min_length=1, description="adapter: what the engine loads (local path or object-store URI)"
    )
    size_mb: float | None = Field(
        default=None,
        gt=0,
        description="adapter: its size, for the predicted load time and a pool's `lora_memory_budget_mb` "
        "(default: its files' size when the source is a local path readable here)",
    )
    tenants: list[str] | None = Field(
        default=None, description="adapter: the tenants that may call it (null: any the keys allow)"
    )
    owner: str | None = Field(default=None, description="adapter: who it belongs to (reported, not enforced)")
    preload: bool | None = Field(
        default=None, description="adapter: loaded on every ready replica of its base's pools, never idle-unloaded"
    )
    idle_unload_s: float | None = Field(
        default=None,
        gt=0,
        description="adapter: unloaded from a replica where it went unused this long (overrides the pool's "
        "`lora_idle_unload_s`)",
    )

    @model_validator(mode="after")
    def _adapter_fields(self) -> ModelConfig:
        if self.kind == "adapter":
            missing = [name for name in ("base", "source") if getattr(self, name) is None]
            if missing:
                raise ValueError(f"an adapter needs {' and '.join(missing)}")
        else:
            adapter_only = ("base", "source", "size_mb", "tenants", "owner", "preload", "idle_unload_s")
            extra = [n for n in adapter_only if getattr(self, n) is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)} only apply to kind: adapter")
        return self

    @field_validator("fallbacks", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        """`fallbacks: [qwen2.5-7b]` is short for `[{model: qwen2.5-7b}]` (every trigger)."""
        if isinstance(value, list):
            return [{"model": v} if isinstance(v, str) else v for v in value]
        return value


class TokenWeights(_Strict):
    """Weights of `count: weighted`, as in Envoy AI Gateway's cost expressions."""

    input: float = Field(default=1.0, ge=0)
    cached_input: float | None = Field(default=None, ge=0, description="defaults to input")
    output: float = Field(default=1.0, ge=0)


class Match(_Strict):
    """Narrows a rule's subjects; an absent field matches every value (one bucket per subject)."""

    key: str | None = None
    tenant: str | None = None
    team: str | None = None
    org: str | None = None
    model: str | None = None
    provider: str | None = Field(default=None, description="scope team_provider: models of this `provider`")
    tag: str | None = Field(default=None, pattern=_TAG_PATTERN, description="scope tag: the tag this rule counts")

    def fields(self) -> dict[str, str]:
        pairs = (
            ("key", self.key),
            ("tenant", self.tenant),
            ("team", self.team),
            ("org", self.org),
            ("model", self.model),
            ("provider", self.provider),
            ("tag", self.tag),
        )
        return {k: v for k, v in pairs if v}


class _Rule(_Strict):
    id: str | None = Field(default=None, pattern=_ID_PATTERN, description="stable identity of its counters")
    scope: Scope
    match: Match = Field(default_factory=Match)
    shadow: bool = Field(default=False, description="counted and reported, never enforced")
    fallback: str | None = Field(
        default=None,
        description="when this rule says no, run the request on this (cheaper) model instead of answering 429, "
        "where the tenant allows fallbacks; tried before the model's own fallbacks",
    )

    @model_validator(mode="after")
    def _match_fits_scope(self) -> _Rule:
        allowed = SCOPE_MATCH_FIELDS[self.scope]
        extra = sorted(set(self.match.fields()) - allowed)
        if extra:
            expected = ", ".join(sorted(allowed)) or "nothing"
            raise ValueError(f"scope {self.scope!r} cannot match on {', '.join(extra)} (expected {expected})")
        if self.scope == "tag" and self.match.tag is None:
            raise ValueError("scope 'tag' counts one named tag: set match.tag")
        return self

    def identity(self, resolve_model: Callable[[str], str] | None = None) -> str:
        """The rule's counter identity: its `id`, else scope and match (e.g. `key[tenant=free]`), with
        a matched model alias resolved by `resolve_model`.

        Store keys derive from it, never from list position, so reordering the file or editing another
        rule keeps this rule's counters across a reload.
        """
        if self.id:
            return self.id
        fields = self.match.fields()
        if not fields:
            return self.scope
        if resolve_model is not None and "model" in fields:
            fields["model"] = resolve_model(fields["model"])
        return f"{self.scope}[{','.join(f'{k}={v}' for k, v in sorted(fields.items()))}]"


class LimitConfig(_Rule):
    rpm: int | None = Field(default=None, ge=1, description="requests per minute")
    rpd: int | None = Field(default=None, ge=1, description="requests per day")
    tpm: int | None = Field(default=None, ge=1, description="tokens per minute")
    tpd: int | None = Field(default=None, ge=1, description="tokens per day")
    max_concurrent: int | None = Field(default=None, ge=1, description="requests in flight")
    calls_per_run: int | None = Field(default=None, ge=1, description="scope program: calls in one agent run")
    tokens_per_run: int | None = Field(default=None, ge=1, description="scope program: tokens in one agent run")
    seconds_per_run: float | None = Field(
        default=None, gt=0, le=31_536_000, description="scope program: wall-clock seconds from a run's first call"
    )
    count: CountMode = Field(default="total", description="which tokens tpm/tpd count")
    weights: TokenWeights | None = None

    @model_validator(mode="after")
    def _has_dimension(self) -> LimitConfig:
        dimensions = ("rpm", "rpd", "tpm", "tpd", "max_concurrent", *RUN_LIMITS)
        if all(getattr(self, d) is None for d in dimensions):
            raise ValueError(f"expected at least one of {', '.join(dimensions)}")
        if self.scope != "program" and any(getattr(self, d) is not None for d in RUN_LIMITS):
            raise ValueError("calls_per_run, tokens_per_run and seconds_per_run count an agent run: scope program")
        if self.weights is not None and self.count != "weighted":
            raise ValueError(f"weights are only read with count: weighted (count is {self.count!r})")
        return self


class BillingPeriod(_Strict):
    """A monthly period that starts on `anchor_day` at 00:00 in `timezone`, as invoices do."""

    anchor_day: int = Field(ge=1, le=28, description="day of the month the period starts (1-28: every month has it)")
    timezone: str = Field(default="UTC", description="IANA zone of the boundary (its offset when the policy loads)")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        if value == "UTC":
            return value  # no time zone database needed
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"unknown time zone {value!r}") from exc
        return value

    def period(self, now: datetime | None = None) -> str:
        """The store's name of this period: `billing:<anchor day>:<UTC offset s>` (policies/limits/memory_store.py)."""
        offset = None if self.timezone == "UTC" else ZoneInfo(self.timezone).utcoffset(now or datetime.now(UTC))
        return f"billing:{self.anchor_day}:{int(offset.total_seconds()) if offset is not None else 0}"


class BudgetConfig(_Rule):
    usd_per_day: float | None = Field(default=None, gt=0, description="resets 00:00 UTC")
    usd_per_month: float | None = Field(default=None, gt=0, description="resets on the 1st, 00:00 UTC")
    usd_per_run: float | None = Field(
        default=None, gt=0, description="scope program: one agent run's spend, never reset (docs/agents.md)"
    )
    usd_per_period: float | None = Field(default=None, gt=0, description="per billing period (`billing`)")
    billing: BillingPeriod | None = Field(default=None, description="the period of usd_per_period")

    @model_validator(mode="after")
    def _has_amount(self) -> BudgetConfig:
        amounts = (self.usd_per_day, self.usd_per_month, self.usd_per_run, self.usd_per_period)
        if all(a is None for a in amounts):
            raise ValueError("expected usd_per_day, usd_per_month, usd_per_period and/or usd_per_run")
        if (self.usd_per_period is None) != (self.billing is None):
            raise ValueError("usd_per_period and billing go together (billing: {anchor_day, timezone})")
        if self.usd_per_run is not None and self.scope != "program":
            raise ValueError("usd_per_run is an agent run's budget: scope program")
        return self


DEFAULT_MAX_QUEUE_MS = 1000.0
DEFAULT_MIN_PROBABILITY = 0.5


class SloClassConfig(_Strict):
    """A latency objective and what to do when no endpoint is predicted to meet it (policies/slo.py).

    `ttft_ms`/`tpot_ms` bound the predicted latency (`compare`: by default an endpoint meets them
    when the predicted chance of meeting both is at least `min_probability`); the headers `x-slo-ttft-ms` and
    `x-slo-tpot-ms` may tighten them per request, never loosen. `on_miss`: `fallback` to the next
    model whose chain step lists `slo_unattainable` (503 when there is none), `queue` up to
    `max_queue_ms` for capacity, `reject` at once (503 `slo_unattainable` with retry-after), or
    `proceed` best effort. Sheddable principals (priority < 0) are shed on a miss whatever it says.
    """

    ttft_ms: float | None = Field(default=None, gt=0, description="time to first token, ms")
    tpot_ms: float | None = Field(default=None, gt=0, description="time per output token after the first, ms")
    on_miss: MissAction = "reject"
    max_queue_ms: float | None = Field(
        default=None, gt=0, description=f"on_miss queue: longest wait for capacity (default {DEFAULT_MAX_QUEUE_MS:g})"
    )
    max_queued: int = Field(default=256, ge=1, description="on_miss queue: waiting at once; more are shed")
    compare: Literal["probability", "p90", "mean"] = Field(
        default="probability",
        description="probability: P(meeting every target) >= min_probability; p90 / mean: that prediction fits",
    )
    min_probability: float = Field(
        default=DEFAULT_MIN_PROBABILITY, gt=0, lt=1, description="compare: probability: the least chance admitted"
    )
    priorities: list[PriorityName] = Field(
        default_factory=list, description="principals of these priorities whose tenant names no slo_class"
    )

    @model_validator(mode="after")
    def _coherent(self) -> SloClassConfig:
        if self.ttft_ms is None and self.tpot_ms is None:
            raise ValueError("expected ttft_ms and/or tpot_ms")
        if "min_probability" in self.model_fields_set and self.compare != "probability":
            raise ValueError(f"min_probability only applies to compare: probability (compare is {self.compare!r})")
        if self.max_queue_ms is not None and self.on_miss != "queue":
            raise ValueError(f"max_queue_ms only applies to on_miss: queue (on_miss is {self.on_miss!r})")
        return self


class BreakerConfig(_Strict):
    """Circuit breaker in front of Redis: a dead store costs no latency while open."""

    failure_threshold: int = Field(default=3, ge=1, description="consecutive failures that open it")
    open_s: float = Field(default=2.0, gt=0, description="how long it stays open before one probe")


class AdmissionConfig(_Strict):
    store_failure: Literal["fail_open", "fail_closed"] = Field(
        default="fail_open",
        description="Redis unreachable: local buckets at limits/replicas (open) or 503 (closed)",
    )
    replicas: int = Field(default=1, ge=1, description="gateway replicas sharing the limits")
    lease_ttl_s: float = Field(default=900.0, gt=0, description="a concurrency lease expires after this")
    concurrency_retry_after_s: float = Field(default=1.0, gt=0)
    local_precheck: bool = Field(
        default=True, description="reject from the last state Redis reported, without a round trip"
    )
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    track_key_spend: bool = Field(
        default=False,
        description="count every file key's spend per day and month (keys made through the admin API always are)",
    )


class BatchPolicy(_Strict):
    """What batch work (the Batch API's lines) pays: `price_factor` times the model's price, unless the
    model's `price.batch_factor` says otherwise (OpenAI's batch discount is 50 %)."""

    price_factor: float = Field(default=0.5, ge=0, le=1)


class PoliciesConfig(_Strict):
    version: Literal[1] = 1
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    orgs: dict[str, OrgConfig] = Field(default_factory=dict)
    teams: dict[str, TeamConfig] = Field(default_factory=dict)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    keys: list[KeyConfig] = Field(default_factory=list)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    limits: list[LimitConfig] = Field(default_factory=list)
    budgets: list[BudgetConfig] = Field(default_factory=list)
    slo_classes: dict[str, SloClassConfig] = Field(default_factory=dict)
    flow_control: FlowPolicy = Field(default_factory=FlowPolicy)
    batch: BatchPolicy = Field(default_factory=BatchPolicy)
    spill: SpillPolicy = Field(default_factory=SpillPolicy)

    @model_validator(mode="after")
    def _references(self) -> PoliciesConfig:
        problems = self.reference_problems()
        if problems:
            raise ReferenceErrors(problems)
        return self

    def canonical_model(self, name: str) -> str | None:
        """The model a name or alias denotes, or None when unknown."""
        if name in self.models:
            return name
        for model_name, model in self.models.items():
            if name in model.aliases:
                return model_name
        return None

    def resolve_model(self, name: str) -> str:
        return self.canonical_model(name) or name

    def allowed_models(self, tenant_models: list[str] | None, key_models: list[str] | None) -> frozenset[str] | None:
        """The models a key may use: its tenant's, narrowed by its own (aliases resolved); None: any."""
        allowed: set[str] | None = None
        if tenant_models is not None:
            allowed = {self.resolve_model(m) for m in tenant_models}
        if key_models is not None:
            narrowed = {self.resolve_model(m) for m in key_models}
            allowed = narrowed if allowed is None else allowed & narrowed
        return frozenset(allowed) if allowed is not None else None

    def reference_problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        key_ids: set[str] = set()
        hashes: set[str] = set()
        for i, key in enumerate(self.keys):
            if key.tenant not in self.tenants:
                problems.append((("keys", i, "tenant"), f"unknown tenant {key.tenant!r}"))
            if key.id in key_ids:
                problems.append((("keys", i, "id"), f"duplicate key id {key.id!r}"))
            if key.sha256 in hashes:
                problems.append((("keys", i, "sha256"), "the same key hash appears twice"))
            key_ids.add(key.id)
            hashes.add(key.sha256)
        owners: dict[str, str] = {}
        for name, model in self.models.items():
            for j, alias in enumerate(model.aliases):
                if alias in self.models or alias in owners:
                    problems.append((("models", name, "aliases", j), f"{alias!r} is already a model or alias"))
                owners[alias] = name
        for name, model in self.models.items():
            for j, step in enumerate(model.fallbacks):
                target = self.canonical_model(step.model)
                path: tuple[str | int, ...] = ("models", name, "fallbacks", j, "model")
                if target is None:
                    problems.append((path, f"unknown model {step.model!r}"))
                elif target == name:
                    problems.append((path, "a model cannot fall back to itself"))
        for section, rules in (("limits", self.limits), ("budgets", self.budgets)):
            seen: dict[str, int] = {}
            for i, rule in enumerate(rules):
                problems.extend(self._match_problems((section, i, "match"), rule.match))
                if rule.fallback is not None and self.canonical_model(rule.fallback) is None:
                    problems.append(((section, i, "fallback"), f"unknown model {rule.fallback!r}"))
                identity = rule.identity(self.resolve_model)
                if identity in seen:
                    problems.append(
                        (
                            (section, i),
                            f"same identity {identity!r} as {section}[{seen[identity]}]; merge them or give each an id",
                        )
                    )
                seen.setdefault(identity, i)
        problems.extend(self._slo_problems())
        problems.extend(self._adapter_problems())
        problems.extend(self._hierarchy_problems())
        return problems

    def _hierarchy_problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        """A tenant's team and a team's organisation exist."""
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for name, team in self.teams.items():
            if team.org is not None and team.org not in self.orgs:
                problems.append((("teams", name, "org"), f"unknown organisation {team.org!r}"))
        for name, tenant in self.tenants.items():
            if tenant.team is not None and tenant.team not in self.teams:
                problems.append((("tenants", name, "team"), f"unknown team {tenant.team!r}"))
        return problems

    def org_of(self, team: str | None) -> str | None:
        """The organisation a team belongs to (None: no team, or a team of none)."""
        config = self.teams.get(team) if team is not None else None
        return config.org if config is not None else None

    def _adapter_problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        """An adapter's base is a known model that is no adapter itself; its tenants exist."""
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for name, model in self.models.items():
            if model.kind != "adapter" or model.base is None:
                continue
            base = self.canonical_model(model.base)
            if base is None:
                problems.append((("models", name, "base"), f"unknown model {model.base!r}"))
            elif self.models[base].kind == "adapter":
                problems.append((("models", name, "base"), f"{model.base!r} is an adapter; name its base model"))
            for j, tenant in enumerate(model.tenants or ()):
                if tenant not in self.tenants:
                    problems.append((("models", name, "tenants", j), f"unknown tenant {tenant!r}"))
        return problems

    def _slo_problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for name, tenant in self.tenants.items():
            if tenant.slo_class is not None and tenant.slo_class not in self.slo_classes:
                known = ", ".join(sorted(self.slo_classes)) or "none defined"
                problems.append((("tenants", name, "slo_class"), f"unknown slo class {tenant.slo_class!r} ({known})"))
        owner: dict[str, str] = {}
        for name, slo_class in self.slo_classes.items():
            for j, priority in enumerate(slo_class.priorities):
                if priority in owner:
                    path: tuple[str | int, ...] = ("slo_classes", name, "priorities", j)
                    problems.append((path, f"priority {priority!r} already has class {owner[priority]!r}"))
                owner.setdefault(priority, name)
        return problems

    def _match_problems(self, path: tuple[str | int, ...], match: Match) -> list[tuple[tuple[str | int, ...], str]]:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if match.key is not None and match.key not in {k.id for k in self.keys}:
            problems.append(((*path, "key"), f"unknown key id {match.key!r}"))
        if match.tenant is not None and match.tenant not in self.tenants:
            problems.append(((*path, "tenant"), f"unknown tenant {match.tenant!r}"))
        if match.team is not None and match.team not in self.teams:
            problems.append(((*path, "team"), f"unknown team {match.team!r}"))
        if match.org is not None and match.org not in self.orgs:
            problems.append(((*path, "org"), f"unknown organisation {match.org!r}"))
        if match.provider is not None and all(m.provider != match.provider for m in self.models.values()):
            problems.append(((*path, "provider"), f"no model has provider {match.provider!r}"))
        if match.model is not None and self.canonical_model(match.model) is None:
            problems.append(((*path, "model"), f"unknown model {match.model!r}"))
        return problems

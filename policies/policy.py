"""A compiled, immutable policy and the decisions read straight off it: the lookup tables the hot path
needs, what a request cost (and whether a spill is worth its price), the next model of a fallback chain,
and the engine fields a client may send.

They live together because each reads only what the compiled policy holds: a model's `fallbacks`
and context length, a tenant's `engine_fields` and `cache_group`, a pool's prices.

The compiled policy
-------------------

A compiled, immutable policy: policies.yaml turned into the lookup tables the hot path needs.

Compiling once per (re)load keeps per-request work to dictionary lookups. Hot reload swaps the whole
object atomically (one attribute assignment on the holder), so a request sees one policy end to end.
`price_usd` is what a request cost under it.

Fallback chains and the context check
-------------------------------------

What to run instead: the next model of a fallback chain, and the context-length check before a call.

Pure functions of (policy, model, trigger, principal). A chain is the model's own `fallbacks` list,
followed transitively (a fallback's own fallbacks come after), each step gated by the triggers it
lists; `tried` lets the caller walk it without cycles whether it passes the original model or the one
it just tried.

Engine fields and the cache salt
--------------------------------

Request fields that steer the engine itself, which clients may not set unless the policy says so.

OpenAI-compatible engines accept, beside the OpenAI fields, fields that control their own machinery
(vLLM `vllm/entrypoints/openai/chat_completion/protocol.py`, TensorRT-LLM's `openai_protocol.py`):
the KV-transfer handshake of disaggregated serving (a client naming `do_remote_prefill` with its own
`remote_host` makes the engine connect there and report the prompt as cached), the scheduler's
priority, the prefix-cache salt, the engine's request and session ids, extra sampling arguments
and, on TensorRT-LLM, LoRA adapters by path. The gateway sets those it needs from its own decisions
(the PD handshake from the prefill engine's answer, the priority from the tenant's tier); from a
client they are dropped, unless the tenant's `engine_fields` names them (a trusted tenant, e.g. one
that runs its own disaggregated client).

The prefix-cache salt is always the gateway's (`cache_salt` below): a tenant allowed to name
`cache_salt` only splits its own cache further, it never reaches another tenant's blocks. The fields
themselves (`ENGINE_CONTROL_FIELDS`) are listed in `policies/schema.py`, which checks a tenant's
`engine_fields` against them.

Spill-over priced
-----------------

Spill-over priced: is a request's predicted wait for its owned pool worth more than what the
overflow pool costs it more? (`spill.usd_per_wait_second`, docs/providers.md, "Spill-over".)

The gate's spill check (`gateway/flow/checks.py`) asks this on every wake of the owned pool's room,
next to its two fixed bounds (`max_wait_ms`, `max_waiting`), so the policy can only make a request
spill sooner, never hold it longer. Plain functions of numbers and price tables: the check brings
the prediction (the room's drain rate) and the prices (`Policy.price(model, pool)`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from backends.fleet import MB, LoraAdapter, local_size_bytes
from policies.keys.records import KeyRecord, TenantRecord
from policies.limits.plan import LimitIndex, Plan, Price, pool_prices_of, price_of
from policies.schema import (
    ENGINE_CONTROL_FIELDS,
    PRIORITY_VALUES,
    FallbackConfig,
    ModelConfig,
    PoliciesConfig,
    TenantConfig,
)
from policies.slo import Slo
from policies.types import NO_SUBJECTS, Principal, Rejection, RequestSubjects, Usage


class KeyAuthority(Protocol):
    """The keys made at run time that a policy consults after its file's: the admin API's
    `policies.keys.directory.KeyDirectory`. A protocol, not that class: the directory compiles
    principals against a `Policy`, so importing it here would close an import cycle."""

    @property
    def keys(self) -> Mapping[str, KeyRecord]: ...
    @property
    def tenants(self) -> Mapping[str, TenantRecord]: ...
    def authenticate(self, digest: bytes, hex_digest: str, policy: Policy) -> Principal | None: ...


def hash_key(api_key: str) -> str:
    """The SHA-256 hex digest under which a key is stored."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class _KeyEntry:
    digest: bytes
    principal: Principal


@dataclass(slots=True)
class TenantView:
    """What every request of one tenant reads off the policy, worked out once per (policy, tenant)
    instead of per request: its policies.yaml entry (None for a tenant made through the admin API or
    unknown), the engine-control fields it may set, its prefix-cache group and that group's salt."""

    config: TenantConfig | None
    engine_fields: tuple[str, ...]
    cache_group: str
    cache_salt: str  # the engine's `cache_salt` of its requests that name none of their own

    @classmethod
    def of(cls, tenant: str, config: TenantConfig | None) -> TenantView:
        group = config.cache_group if config is not None else None
        cache_group = f"group:{group}" if group else f"tenant:{tenant}"
        fields = tuple(config.engine_fields) if config is not None else ()
        return cls(config, fields, cache_group, cache_salt(cache_group))


_MAX_TENANT_VIEWS = 65_536  # tenants come from configuration and the admin API: bounded anyway


class Policy:
    def __init__(self, config: PoliciesConfig, source: str = "<memory>", directory: KeyAuthority | None = None) -> None:
        self.config = config
        self.source = source
        self.directory = directory  # keys made through the admin API, consulted after the file's
        track = config.admission.track_key_spend
        self._keys: dict[str, _KeyEntry] = {}
        self._principals: dict[str, Principal] = {}
        for key in config.keys:
            if key.disabled:
                continue
            tenant = config.tenants[key.tenant]
            priority = PRIORITY_VALUES[key.priority or tenant.priority]
            principal = Principal(
                key_id=key.id,
                tenant=key.tenant,
                allowed_models=config.allowed_models(tenant.models, key.models),
                priority=priority,
                allow_fallback=tenant.allow_fallback,
                track_spend=track,
                team=tenant.team,
                show_cost=tenant.show_cost if key.show_cost is None else key.show_cost,
            )
            self._keys[key.sha256] = _KeyEntry(bytes.fromhex(key.sha256), principal)
            self._principals[key.id] = principal
        self._aliases: dict[str, str] = {}
        for name, model in config.models.items():
            self._aliases[name] = name
            for alias in model.aliases:
                self._aliases[alias] = name
        self._fallbacks: dict[str, tuple[FallbackConfig, ...]] = {
            name: tuple(
                FallbackConfig(model=config.resolve_model(step.model), triggers=step.triggers)
                for step in model.fallbacks
            )
            for name, model in config.models.items()
        }
        self._prices: dict[str, Price] = {name: price_of(model) for name, model in config.models.items()}
        self._pool_prices: dict[tuple[str, str], Price] = {
            (name, pool): price for name, model in config.models.items() for pool, price in pool_prices_of(model)
        }
        self.adapters: Mapping[str, LoraAdapter] = compile_adapters(config)
        self._adapter_tenants = {
            name: frozenset(model.tenants)
            for name, model in config.models.items()
            if model.kind == "adapter" and model.tenants is not None
        }
        self.limits = LimitIndex(config)
        if directory is not None and hasattr(directory, "overrides_generation"):
            self.limits.follow_overrides(directory)  # type: ignore[arg-type]  # the admin API's overrides
        slo_classes = {name: Slo.from_config(name, c) for name, c in config.slo_classes.items()}
        self._slo_classes = slo_classes
        self._slo_by_tenant = {
            name: slo_classes[t.slo_class] for name, t in config.tenants.items() if t.slo_class is not None
        }
        self._slo_by_priority = {
            PRIORITY_VALUES[priority]: slo_classes[name]
            for name, c in config.slo_classes.items()
            for priority in c.priorities
        }
        # per tenant, filled as its requests come: dropped with this policy on reload (no stale view)
        self._tenant_views: dict[str, TenantView] = {}

    def tenant_view(self, tenant: str) -> TenantView:
        """The tenant's `TenantView` under this policy (made on its first request, then kept)."""
        view = self._tenant_views.get(tenant)
        if view is None:
            view = TenantView.of(tenant, self.config.tenants.get(tenant))
            if len(self._tenant_views) < _MAX_TENANT_VIEWS:
                self._tenant_views[tenant] = view
        return view

    def authenticate(self, api_key: str) -> Principal | None:
        """The principal of a presented key, or None. The digest comparison is constant-time. A key
        that is not valid text (undecodable header bytes) is no key."""
        try:
            digest = hashlib.sha256(api_key.encode("utf-8")).digest()
        except UnicodeEncodeError:
            return None
        hex_digest = digest.hex()
        entry = self._keys.get(hex_digest)
        if entry is None:
            return self.directory.authenticate(digest, hex_digest, self) if self.directory is not None else None
        if not hmac.compare_digest(entry.digest, digest):
            return None
        return entry.principal

    def file_principal(self, key_id: str) -> Principal | None:
        """The principal of a policies.yaml key by id (the admin API's view of file keys)."""
        for entry in self._keys.values():
            if entry.principal.key_id == key_id:
                return entry.principal
        return None

    def resolve_model(self, name: str) -> str:
        """Public model name for a name or alias (unknown names resolve to themselves)."""
        return self._aliases.get(name, name)

    def adapter_allows(self, model: str, tenant: str) -> bool:
        """Whether `tenant` may call `model`: always, unless it is an adapter that names its tenants."""
        allowed = self._adapter_tenants.get(model)
        return allowed is None or tenant in allowed

    def model_config(self, model: str) -> ModelConfig | None:
        return self.config.models.get(model)

    def engine_fields(self, principal: Principal) -> tuple[str, ...]:
        """The engine-control fields the caller's tenant may set (`tenants.<t>.engine_fields`)."""
        return self.tenant_view(principal.tenant).engine_fields

    def cache_group(self, principal: Principal) -> str:
        """Whose prefix cache the caller's requests share: its tenant's `cache_group` (an explicit
        policy: the tenants naming it trust each other), else the tenant alone."""
        return self.tenant_view(principal.tenant).cache_group

    def fallbacks(self, model: str) -> tuple[FallbackConfig, ...]:
        """The model's fallback chain, targets resolved to model names."""
        return self._fallbacks.get(model, ())

    def price(self, model: str, pool: str | None = None) -> Price:
        """USD per token of `model` served by `pool`: the pool's own price for it (`pool_prices`), else
        the model's (zero for a model without a price)."""
        if pool is not None and self._pool_prices:
            found = self._pool_prices.get((model, pool))
            if found is not None:
                return found
        return self._prices.get(model) or Price()

    def batch_price_factor(self, model: str) -> float:
        """The share of `model`'s price a batch line pays (its `price.batch_factor`, else `batch.price_factor`)."""
        config = self.config.models.get(model)
        if config is not None and config.price.batch_factor is not None:
            return config.price.batch_factor
        return self.config.batch.price_factor

    def principal_of(self, key_id: str) -> Principal | None:
        """The principal of a key by its id (batch lines run as the key that created the batch); None
        when the key is gone or disabled."""
        return self._principals.get(key_id)

    def slo_class(self, principal: Principal) -> Slo | None:
        """The caller's SLO class: its tenant's `slo_class`, else the class claiming its priority."""
        found = self._slo_by_tenant.get(principal.tenant)
        if found is None and principal.slo_class is not None:
            found = self._slo_classes.get(principal.slo_class)
        return found if found is not None else self._slo_by_priority.get(principal.priority)

    def tenant_weight(self, tenant: str) -> float:
        """The tenant's weight in a saturated pool (flow control), 1 for a tenant the policy lacks."""
        found = self.config.tenants.get(tenant)
        return found.weight if found is not None else 1.0

    def program_half_life(self, tenant: str) -> float | None:
        """The half-life of the tenant's program-fair queueing (docs/agents.md); None: off for it."""
        found = self.config.tenants.get(tenant)
        if found is None or found.program_fairness is None:
            return None
        return found.program_fairness.half_life_s

    def admission_plan(self, principal: Principal, model: str, subjects: RequestSubjects = NO_SUBJECTS) -> Plan:
        """Every bucket, lease and budget that applies to `principal` calling `model` (cached), with
        those of the request's own end user, tags and agent program."""
        return self.limits.request_plan(principal, model, subjects)


def compile_adapters(config: PoliciesConfig) -> dict[str, LoraAdapter]:
    """The `kind: adapter` models as the fleet and the transport use them, bases resolved."""
    out: dict[str, LoraAdapter] = {}
    for name, model in config.models.items():
        if model.kind == "adapter" and model.base is not None and model.source is not None:
            # the policy's size, else the files' when the source is a local path readable here
            size = int(model.size_mb * MB) if model.size_mb is not None else local_size_bytes(model.source)
            out[name] = LoraAdapter(
                name,
                config.resolve_model(model.base),
                model.source,
                size,
                preload=bool(model.preload),
                idle_unload_s=model.idle_unload_s,
            )
    return out


def usage_cost_usd(price: Price, usage: Usage) -> float:
    """`usage` at `price`: cache reads, cache writes (each lifetime) and reasoning at their own rates."""
    return price.cost_usd(
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.completion_tokens,
        cache_write_tokens=usage.cache_write_tokens,
        cache_write_1h_tokens=usage.cache_write_1h_tokens,
        reasoning_tokens=usage.reasoning_tokens,
    )


def cache_saving_usd(
    policy: Policy, model: str, usage: Usage, cost_usd: float, batch: bool = False, pool: str | None = None
) -> float:
    """What the prompt cache saved on a request that cost `cost_usd`: its cost with every prompt token
    at the plain input rate, less `cost_usd` (negative when cache writes cost more than reads saved)."""
    price = policy.price(model, pool)
    uncached = price.uncached_usd(usage.prompt_tokens, usage.completion_tokens, usage.reasoning_tokens)
    return (uncached * policy.batch_price_factor(model) if batch else uncached) - cost_usd


def price_usd(policy: Policy, model: str, usage: Usage, *, batch: bool = False, pool: str | None = None) -> float:
    """USD cost of `usage` on `model` served by `pool` (its `pool_prices` entry, else the model's
    price; None: the model's); 0.0 for a model without a price. A batch line pays the model's batch
    share of it (`Policy.batch_price_factor`).

    Usage x the model's price table (USD per million tokens, cached input apart). Cached prompt
    tokens (served from the engine's prefix cache) are billed at `cached_input_per_mtok`, which
    defaults to the input price. Budgets are charged with this same figure after each request. Batch
    lines pay a share of it (`batch.price_factor`, or the model's `price.batch_factor`).
    """
    cost = usage_cost_usd(policy.price(model, pool), usage)
    return cost * policy.batch_price_factor(model) if batch else cost


def choose_fallback(
    policy: Policy,
    model: str,
    trigger: str,
    principal: Principal,
    opt_out: bool = False,
    *,
    tried: Collection[str] = (),
    min_context_tokens: int | None = None,
) -> str | None:
    """The first model of `model`'s chain that `trigger` may use, the caller may call, and that was not
    tried; None when the tenant disallows fallbacks, the request opted out, or none is left.
    For `context_too_long`, `min_context_tokens` (prompt + max_tokens) skips models too small."""
    if opt_out or not principal.allow_fallback:
        return None
    seen = {model}
    queue = [model]
    while queue:
        current = queue.pop(0)
        for step in policy.fallbacks(current):
            candidate = step.model
            if trigger not in step.triggers or candidate in seen:
                continue  # a step the trigger may not take also hides what lies behind it
            seen.add(candidate)
            queue.append(candidate)
            if candidate in tried or not principal.may_use(candidate):
                continue
            if trigger == "context_too_long" and not _fits(policy, candidate, min_context_tokens):
                continue
            return candidate
    return None


def _fits(policy: Policy, model: str, need_tokens: int | None) -> bool:
    config = policy.model_config(model)
    if config is None or config.context_length is None or need_tokens is None:
        return True
    return need_tokens <= config.context_length


def context_tokens(prompt_tokens: int, max_tokens: int | None) -> int:
    """Context a request needs: prompt + max_tokens, or prompt + 1 (room for one token) without it."""
    return prompt_tokens + (max_tokens if max_tokens is not None else 1)


def check_context(policy: Policy, model: str, prompt_tokens: int, max_tokens: int | None) -> Rejection | None:
    """400 `context_length_exceeded` (param `messages`, reason `context_too_long`) when prompt +
    max_tokens exceed the model's context length; None when it fits or the length is unknown."""
    config = policy.model_config(model)
    if config is None or config.context_length is None:
        return None
    needed = context_tokens(prompt_tokens, max_tokens)
    if needed <= config.context_length:
        return None
    completion = f"{max_tokens} in the completion" if max_tokens is not None else "at least 1 in the completion"
    message = (
        f"This model's maximum context length is {config.context_length} tokens. However, you requested "
        f"{needed} tokens ({prompt_tokens} in the messages, {completion}). "
        "Please reduce the length of the messages or completion."
    )
    return Rejection(
        status=400,
        message=message,
        type="invalid_request_error",
        code="context_length_exceeded",
        param="messages",
        reason="context_too_long",
    )


def client_body(body: Mapping[str, Any], allowed: Collection[str] = ()) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`body` without the engine-control fields `allowed` does not name, and the names dropped. The
    body is returned as it is (no copy) when it carries none, which is almost always."""
    if ENGINE_CONTROL_FIELDS.isdisjoint(body):  # almost always: no set made, no generator, no sort
        return body if isinstance(body, dict) else dict(body), ()
    present = ENGINE_CONTROL_FIELDS.intersection(body)
    dropped = tuple(sorted(name for name in present if name not in allowed))
    if not dropped:
        return body if isinstance(body, dict) else dict(body), ()
    return {k: v for k, v in body.items() if k not in dropped}, dropped


# The salt needs no secret: clients cannot set the engine's `cache_salt` (it is dropped above), so a
# salt only has to differ between cache groups, be the same on every gateway replica (the engines'
# caches and the prefix index are shared by all of them) and not spell the tenant's name out in the
# engine's logs. A keyed BLAKE2b of the group does all three; the key only separates this use.
_SALT_KEY = b"tokenway prefix-cache salt v1"


def cache_salt(group: str, client_salt: str | None = None) -> str:
    """The engine's `cache_salt` for a request of cache group `group` (`tenants.<t>.cache_group`,
    else the tenant's name). A trusted tenant's own salt (`engine_fields: [cache_salt]`) is folded
    in, so it splits that group's cache but can never name another group's."""
    if not client_salt:
        return _group_salt(group)  # every request pays this: the groups are few, their salts kept
    return _salt(group, client_salt)


@functools.lru_cache(maxsize=4096)  # groups are tenants' (configuration or the admin API): bounded anyway
def _group_salt(group: str) -> str:
    return _salt(group, None)


def _salt(group: str, client_salt: str | None) -> str:
    name = group.encode("utf-8", "surrogatepass")
    material = b"%d:%s" % (len(name), name)  # length-prefixed: no (group, salt) pair spells another
    if client_salt:
        material += client_salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(material, key=_SALT_KEY, digest_size=16).hexdigest()


def extra_usd(owned: Price, overflow: Price, prompt_tokens: int, output_tokens: int) -> float:
    """USD the overflow pool costs a request of `prompt_tokens` and `output_tokens` more than the owned
    pool (negative when it is cheaper). Both at their plain rates, the long-context tier included: a
    prompt cache hit on either side is not known before the call, so neither is assumed."""
    return overflow.uncached_usd(prompt_tokens, output_tokens) - owned.uncached_usd(prompt_tokens, output_tokens)


def worth_spilling(predicted_wait_s: float | None, usd_per_wait_second: float, extra: float) -> bool:
    """Spill when waiting would cost more than spilling: `predicted_wait_s` (s) x `usd_per_wait_second`
    (USD/s) > `extra` (USD). No prediction (None: nothing has left the room lately to measure it by) or
    no wait ahead (0) never spills on price: the fixed bounds decide then. An overflow pool cheaper
    than the owned one (`extra` < 0) is worth any wait, even one valued at nothing."""
    if predicted_wait_s is None or predicted_wait_s <= 0.0:
        return False
    return predicted_wait_s * usd_per_wait_second > extra

"""Cross-file checks of gateway.yaml against policies.yaml: what each file's own schema cannot see.

Each file validates itself (pydantic, precise key paths); what breaks between them goes unnoticed
until a request takes the broken path: an alias that hides a pool, a fallback to a model nothing
serves, a served model without a price (served free), an allow-list naming a model that does not
exist. `config_findings` lists them as plain values; the gateway logs them at start-up and on every
policy reload (and refuses to start on an error), and `tokenway check --config` prints them, plus
`probe_endpoints`' warnings about static endpoints that do not answer.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from backends.config import PoolConfig
from backends.fleet import MB, budget_bytes, local_size_bytes
from gateway.app.settings import GatewaySettings
from policies.schema import PoliciesConfig, TierPriceConfig

Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Finding:
    severity: Severity
    where: str  # file and key path, e.g. "policies.yaml: models.qwen2.5-7b.aliases[0]"
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.where}: {self.message}"


def config_findings(
    settings: GatewaySettings, policies: PoliciesConfig, policies_source: str = "policies.yaml"
) -> list[Finding]:
    """Every cross-file problem of (gateway.yaml, policies.yaml); errors first."""
    gw = settings.source
    pools = list(settings.pools)
    served = {pool.model for pool in pools}
    found: list[Finding] = []
    found += _readiness(settings, pools)
    found += _shadowing(policies, pools, policies_source)
    found += _fallbacks(policies, served, policies_source)
    found += _unpriced(policies, pools, gw)
    found += _pool_prices(policies, pools, policies_source)
    found += _allow_lists(policies, served, policies_source)
    found += _adapter_routing(settings, policies, pools)
    found += _adapter_budgets(policies, pools, policies_source)
    found += _role_teams(settings, policies, policies_source)
    return sorted(found, key=lambda f: f.severity != "error")


def _role_teams(settings: GatewaySettings, policies: PoliciesConfig, source: str) -> list[Finding]:
    """Teams a team admin manages (server.users, server.oidc.group_roles) that policies.yaml lacks: a
    warning, not an error (the team may come with the next policies.yaml), but it grants nothing now."""
    named = [(f"server.users[{i}].teams", u.teams) for i, u in enumerate(settings.server.users)]
    oidc = settings.server.oidc
    if oidc is not None:
        named += [(f"server.oidc.group_roles.{g}.teams", r.teams) for g, r in oidc.group_roles.items()]
    return [
        Finding(
            "warning", f"{settings.source}: {where}", f"team {team!r} is not in {source}'s teams: it manages nothing"
        )
        for where, teams in named
        for team in teams
        if team not in policies.teams
    ]


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


def _readiness(settings: GatewaySettings, pools: Sequence[PoolConfig]) -> list[Finding]:
    name = settings.server.default_pool
    if name is not None and name not in {p.name for p in pools}:
        known = ", ".join(p.name for p in pools) or "none"
        return [Finding("error", f"{settings.source}: server.default_pool", f"no pool named {name!r} (pools: {known})")]
    return []


def _shadowing(policies: PoliciesConfig, pools: Sequence[PoolConfig], source: str) -> list[Finding]:
    """An alias equal to a pool's model name: requests for that name resolve to the alias's model, so
    the pool never receives one."""
    found = []
    by_model = {pool.model: pool.name for pool in pools}
    for name, model in policies.models.items():
        for j, alias in enumerate(model.aliases):
            pool = by_model.get(alias)
            if pool is not None:
                found.append(
                    Finding(
                        "error",
                        f"{source}: models.{name}.aliases[{j}]",
                        f"alias {alias!r} shadows pool {pool!r}, which serves model {alias!r}: requests for "
                        f"{alias!r} resolve to {name!r} and that pool never receives one",
                    )
                )
    return found


def _fallbacks(policies: PoliciesConfig, served: set[str], source: str) -> list[Finding]:
    found = []
    for name, model in policies.models.items():
        for j, step in enumerate(model.fallbacks):
            target = policies.resolve_model(step.model)
            if target not in served:
                found.append(
                    Finding(
                        "warning",
                        f"{source}: models.{name}.fallbacks[{j}].model",
                        f"fallback target {step.model!r} has no pool in gateway.yaml: that step always fails over",
                    )
                )
    return found


def _unpriced(policies: PoliciesConfig, pools: Sequence[PoolConfig], gw: str) -> list[Finding]:
    found = []
    for i, pool in enumerate(pools):
        model = policies.models.get(policies.resolve_model(pool.model))
        where = f"{gw}: pools[{i}].model"
        if model is None:
            found.append(
                Finding(
                    "warning",
                    where,
                    f"pool {pool.name!r} serves {pool.model!r}, which policies.yaml does not list: no price (served "
                    "free), no context length check, no fallbacks",
                )
            )
        elif _free(model.pool_prices.get(pool.name) or model.price):
            found.append(
                Finding(
                    "warning",
                    where,
                    f"model {pool.model!r} of pool {pool.name!r} has no price: budgets never charge it",
                )
            )
    return found


def _free(price: TierPriceConfig) -> bool:
    return price.input_per_mtok == 0 and price.output_per_mtok == 0


def _pool_prices(policies: PoliciesConfig, pools: Sequence[PoolConfig], source: str) -> list[Finding]:
    """A `pool_prices` entry naming no pool of its model: it never prices a request, yet every
    reservation for the model still holds the dearest of its prices (a warning: the pool may come with
    the next gateway.yaml)."""
    serving: dict[str, set[str]] = {}
    for pool in pools:
        serving.setdefault(policies.resolve_model(pool.model), set()).add(pool.name)
    found = []
    for name, model in policies.models.items():
        base = policies.resolve_model(model.base) if model.kind == "adapter" and model.base else name
        found += [
            Finding(
                "warning",
                f"{source}: models.{name}.pool_prices.{pool}",
                f"no pool {pool!r} serves {name!r} in gateway.yaml: this price never applies, though "
                "reservations for the model still hold the dearest of its prices",
            )
            for pool in model.pool_prices
            if pool not in serving.get(base, set())
        ]
    return found


def _adapter_routing(settings: GatewaySettings, policies: PoliciesConfig, pools: Sequence[PoolConfig]) -> list[Finding]:
    """A pool serving the base model of LoRA adapters whose pipeline does not weigh where adapters are
    loaded: adapter requests would be spread over replicas that must each load them (docs/adapters.md).
    The default pipeline leaves the adapter scorer out because adding a scorer re-weighs every request's
    ranking, adapter or not."""
    adapters: dict[str, list[str]] = {}
    for name, model in policies.models.items():
        if model.kind == "adapter" and model.base is not None:
            adapters.setdefault(policies.resolve_model(model.base), []).append(name)
    found = []
    for i, pool in enumerate(pools):
        names = adapters.get(policies.resolve_model(pool.model))
        pipeline = settings.routing.pipeline_for(pool.name)
        if not names or pipeline.router != "scoring":
            continue
        if not any(spec.type == "lora-affinity" for spec in pipeline.scorers):
            listed = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            found.append(
                Finding(
                    "warning",
                    f"{settings.source}: pools[{i}]",
                    f"pool {pool.name!r} serves the base model of LoRA adapters ({listed}) but its routing pipeline "
                    "has no lora-affinity scorer (and lora-slots filter): adapter requests ignore which replica "
                    "holds them (docs/adapters.md)",
                )
            )
    return found


def _adapter_budgets(policies: PoliciesConfig, pools: Sequence[PoolConfig], source: str) -> list[Finding]:
    """A LoRA adapter larger than a pool's `lora_memory_budget_mb` (its `size_mb`, else its files' size
    when readable here) can never be loaded there: an error when no pool serving its base can hold it
    (every request for it would be refused with a 400), a warning when some cannot (they never get it)."""
    found = []
    for name, model in policies.models.items():
        if model.kind != "adapter" or model.base is None or model.source is None:
            continue
        size = int(model.size_mb * MB) if model.size_mb is not None else local_size_bytes(model.source)
        base = policies.resolve_model(model.base)
        serving = [(pool.name, budget_bytes(pool.lora_memory_budget_mb)) for pool in pools if pool.model == base]
        if size is None or not serving:
            continue
        small = [(pool, budget) for pool, budget in serving if budget is not None and size > budget]
        if not small:
            continue
        listed = ", ".join(f"{pool} ({budget / MB:g} MB)" for pool, budget in small)
        everywhere = len(small) == len(serving)
        found.append(
            Finding(
                "error" if everywhere else "warning",
                f"{source}: models.{name}",
                f"adapter {name!r} ({size / MB:g} MB) is larger than the LoRA memory budget (lora_memory_budget_mb) "
                f"of {listed}: "
                + ("every request for it would be refused" if everywhere else "those pools never serve it"),
            )
        )
    return found


def _allow_lists(policies: PoliciesConfig, served: set[str], source: str) -> list[Finding]:
    """Model names in tenants' and keys' allow-lists and in limit matches that name nothing."""
    known = set(policies.models) | {a for m in policies.models.values() for a in m.aliases} | served
    found = []

    def check(where: str, names: list[str] | None) -> None:
        for j, name in enumerate(names or []):
            if name not in known:
                found.append(
                    Finding("warning", f"{source}: {where}[{j}]", f"unknown model {name!r}: it matches nothing")
                )

    for tenant_name, tenant in policies.tenants.items():
        check(f"tenants.{tenant_name}.models", tenant.models)
    for i, key in enumerate(policies.keys):
        check(f"keys[{i}].models", key.models)
    for section, rules in (("limits", policies.limits), ("budgets", policies.budgets)):
        for i, rule in enumerate(rules):
            model = rule.match.model
            target = policies.resolve_model(model) if model else None
            if target is not None and target not in served:
                found.append(
                    Finding(
                        "warning",
                        f"{source}: {section}[{i}].match.model",
                        f"model {model!r} has no pool in gateway.yaml: this rule never applies",
                    )
                )
    return found


async def probe_endpoints(pools: Sequence[PoolConfig], timeout_s: float = 2.0) -> list[Finding]:
    """A TCP connect to every static endpoint; one that does not answer is a warning (it may come up
    later: the gateway health-checks it and routes around it meanwhile)."""
    targets: list[tuple[str, str, int]] = []
    for i, pool in enumerate(pools):
        for j, endpoint in enumerate(pool.endpoints):
            parts = urlsplit(endpoint.url)
            if not parts.hostname:
                continue
            port = parts.port or (443 if parts.scheme == "https" else 80)
            targets.append((f"pools[{i}].endpoints[{j}] ({endpoint.url})", parts.hostname, port))

    async def one(where: str, host: str, port: int) -> Finding | None:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        except (OSError, TimeoutError) as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
            return Finding("warning", where, f"unreachable: {reason}")
        writer.close()
        return None

    results = await asyncio.gather(*(one(*t) for t in targets))
    return [r for r in results if r is not None]


def check_files(path: str, *, probe: bool = True, unset: list[str] | None = None) -> list[Finding]:
    """Everything `tokenway check` reports about a gateway.yaml and the policies.yaml it names:
    each file's own validation (every room's section with it), the launch plan (what each engine
    would refuse), the cross-file findings and (with `probe`) static endpoints that do not answer."""
    from backends.plan import plan_replicas
    from backends.types import PlanError
    from gateway.app.settings import ConfigError, load_settings
    from policies.loader import PolicyFileError, load_config

    try:
        settings = load_settings(path, unset)
    except ConfigError as exc:
        return [Finding("error", path, str(exc).removeprefix(f"{path}: "))]
    found: list[Finding] = [
        Finding("warning", path, f"{where}: environment variable {name} is not set (shown as ${{{name}}})")
        for where, _, name in (item.partition(": ") for item in unset or [])
    ]
    for i, pool in enumerate(settings.pools):  # a hosted pool's key is read once, at start-up
        if pool.api_key_env is not None and not os.environ.get(pool.api_key_env):
            found.append(
                Finding(
                    "error" if unset is None else "warning",
                    f"{path}: pools[{i}].api_key_env",
                    f"environment variable {pool.api_key_env} is not set: the gateway would not start",
                )
            )
    refused = False
    for i, pool in enumerate(settings.pools):  # each pool alone first: every refusal, not the first one
        try:
            plan_replicas([pool], settings.backends)
        except PlanError as exc:
            refused = True
            found.append(Finding("error", f"{path}: pools[{i}]", str(exc)))
    if not refused:  # then together: devices and ports the pools compete for
        try:
            plan_replicas(list(settings.pools), settings.backends)
        except PlanError as exc:
            found.append(Finding("error", f"{path}: pools", str(exc)))
    policies_path = settings.resolve_path(settings.policies)
    try:
        policies = load_config(policies_path)
    except PolicyFileError as exc:
        found += [
            Finding("error", str(policies_path), m.removeprefix(f"{policies_path}:").strip()) for m in exc.messages
        ]
    else:
        found += config_findings(settings, policies, str(policies_path))
    if probe:
        found += asyncio.run(probe_endpoints(settings.pools))
    return sorted(found, key=lambda f: f.severity != "error")

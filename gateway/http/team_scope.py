"""What a team admin may read: its teams, their tenants and keys, and the one filter of each kind of
row the admin reads return (a request's row, a limit's counters, an override, an audit record).

A route whose answer holds per-tenant or per-key data declares `Reach.TEAM` in `access.TEAM_READS`; its
handler asks `team_view(request)` and, when that is not None (the caller is a team admin), keeps only
the rows the view `sees`. The view is built once per request from the running policies.yaml and the
admin API's directory, so a tenant moved to another team moves out of its old team admin's reach at
once, for past records too (a ledger record names its tenant, whose team is looked up now).

Whatever names no team (a `global`, `model`, `org` or `tag` limit; an override of such a rule for every
subject; the fleet-wide counters of the overview) is another team's as much as this one's, so it is
not shown: a team admin sees what is provably its teams', never a share of what is everyone's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.app import keys as appkeys
from gateway.http.access import identity_of
from policies.keys.directory import KeyDirectory
from policies.policy import Policy
from policies.schema import BudgetConfig, LimitConfig

# Limit scopes whose subject starts with (or is) a tenant, a key or a team, and how to read it:
# `key_model` is "KEY/MODEL", `team_provider` "TEAM/PROVIDER", `user` and `program` "TENANT/NAME"
# (policies/limits/plan.py `_subject`). Names of keys, tenants and teams hold no "/".
_SUBJECT_OWNER = {
    "key": "key",
    "key_model": "key",
    "tenant": "tenant",
    "user": "tenant",
    "program": "tenant",
    "team": "team",
    "team_provider": "team",
}


def tenant_team(policy: Policy, directory: KeyDirectory | None, tenant: str | None) -> str | None:
    """The team of a tenant of policies.yaml or of the admin API (None: no team, or no such tenant)."""
    if tenant is None:
        return None
    file_tenant = policy.config.tenants.get(tenant)
    if file_tenant is not None:
        return file_tenant.team
    record = directory.tenants.get(tenant) if directory is not None else None
    return record.team if record is not None else None


def key_tenant(policy: Policy, directory: KeyDirectory | None, key_id: str) -> str | None:
    """The tenant of a key of the admin API or of policies.yaml (None: no such key)."""
    record = directory.keys.get(key_id) if directory is not None else None
    if record is not None:
        return record.tenant
    return next((k.tenant for k in policy.config.keys if k.id == key_id), None)


@dataclass(frozen=True, slots=True)
class TeamView:
    """A team admin's reach, fixed for one request. Its sets are frozen, so a worker thread (the usage
    report, the audit read) may call `sees_*` while the event loop goes on."""

    actor: str
    teams: frozenset[str]
    tenants: frozenset[str]  # every tenant of those teams, of policies.yaml and of the admin API
    keys: frozenset[str]  # every key of those tenants
    rules: Mapping[
        str, LimitConfig | BudgetConfig
    ]  # rule identity -> the rule of policies.yaml (an override's scope and match)

    def sees_tenant(self, tenant: object) -> bool:
        return isinstance(tenant, str) and tenant in self.tenants

    def sees_key(self, key_id: object) -> bool:
        return isinstance(key_id, str) and key_id in self.keys

    def sees_request(self, row: Mapping[str, Any]) -> bool:
        """A request's row (a ledger record, a live-tail row): its tenant is one of the teams'."""
        return self.sees_tenant(row.get("tenant"))

    def sees_counter(self, scope: object, subject: object) -> bool:
        """A limit's or budget's counters (`/admin/status` rows): its subject is a key, tenant or team
        of these teams; a counter shared beyond them (global, model, org, tag) is not."""
        owner = _SUBJECT_OWNER.get(str(scope))
        if owner is None or not isinstance(subject, str):
            return False
        name = subject.split("/", 1)[0]
        if owner == "key":
            return self.sees_key(name)
        if owner == "tenant":
            return self.sees_tenant(name)
        return name in self.teams

    def sees_override(self, view: Mapping[str, Any]) -> bool:
        """An override (its view): one for a subject of these teams, or one for every subject of a rule
        that counts only them (a rule matched to one of their teams, tenants or keys)."""
        rule = self.rules.get(str(view.get("rule")))
        if rule is None:
            return False
        subject = view.get("subject")
        if subject is not None:
            return self.sees_counter(rule.scope, subject)
        match = rule.match
        return (
            (match.team is not None and match.team in self.teams)
            or self.sees_tenant(match.tenant)
            or self.sees_key(match.key)
        )

    def sees_change(self, record: Mapping[str, Any]) -> bool:
        """An audit record: a change this user made, or a change of one of these teams' keys, tenants
        or overrides (read from the object as it was before or after, so a deleted one still counts)."""
        if record.get("actor") == self.actor:
            return True
        route = str(record.get("route", ""))
        views = [v for v in (record.get("before"), record.get("after")) if isinstance(v, Mapping)]
        if route.startswith("/admin/keys"):
            return any(self.sees_tenant(v.get("tenant")) for v in views) or self.sees_key(record.get("target"))
        if route.startswith("/admin/tenants"):
            return any(v.get("team") in self.teams for v in views) or self.sees_tenant(record.get("target"))
        if route.startswith("/admin/overrides"):
            return any(self.sees_override(v) for v in views)
        return False


def build_view(actor: str, teams: frozenset[str], policy: Policy, directory: KeyDirectory | None) -> TeamView:
    """The view of a team admin of `teams` under this policy and directory."""
    tenants = {name for name, t in policy.config.tenants.items() if t.team in teams}
    if directory is not None:
        tenants |= {name for name, t in directory.tenants.items() if t.team in teams}
    keys = {k.id for k in policy.config.keys if k.tenant in tenants}
    if directory is not None:
        keys |= {k.id for k in directory.keys.values() if k.tenant in tenants}
    rules: dict[str, LimitConfig | BudgetConfig] = {rule.identity(): rule for rule in policy.config.limits}
    rules.update((rule.identity(), rule) for rule in policy.config.budgets)
    return TeamView(actor, teams, frozenset(tenants), frozenset(keys), rules)


def team_view(request: web.Request) -> TeamView | None:
    """The caller's view when it is a team admin; None for a viewer or an admin (they read it all)."""
    identity = identity_of(request)
    if identity.team_scope is None:
        return None
    return build_view(
        identity.actor,
        identity.team_scope,
        request.app[appkeys.POLICIES].current,
        request.app.get(appkeys.DIRECTORY),
    )

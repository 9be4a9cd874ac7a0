"""A team admin's reach (gateway/http/team_scope.py): which tenants, keys, limit counters, overrides
and audit records are its teams', from a real policies.yaml and a real key directory; and the usage
CSV's cells (gateway/console/usage.py), which a spreadsheet must never run as formulas."""

from __future__ import annotations

import csv
import io
import time

import pytest
import yaml

from gateway.console.usage import safe_cell, usage_csv
from gateway.http.team_scope import TeamView, build_view, key_tenant, tenant_team
from gateway.ledger.report import METRIC_COLUMNS
from policies.policy import Policy
from policies.schema import PoliciesConfig

POLICY = """
teams: {search: {}, ads: {}}
tenants:
  search-web: {team: search}
  ads-bid: {team: ads}
  loose: {}
keys:
  - {id: search-1, tenant: search-web, sha256: "SEARCH"}
  - {id: ads-1, tenant: ads-bid, sha256: "ADS"}
models: {llama-3.1-8b: {}}
limits:
  - {id: search-daily-rpm, scope: tenant, match: {team: search}, rpm: 100}
  - {id: tenant-rpm, scope: tenant, rpm: 100}
  - {id: all-rpm, scope: global, rpm: 1000}
budgets:
  - {id: team-daily, scope: team, usd_per_day: 10}
""".replace("SEARCH", "a" * 64).replace("ADS", "b" * 64)


@pytest.fixture
def policy() -> Policy:
    return Policy(PoliciesConfig.model_validate(yaml.safe_load(POLICY)))


def view_of(policy: Policy) -> TeamView:
    return build_view("user:tom", frozenset({"search"}), policy, None)


def test_the_view_holds_the_teams_tenants_and_keys(policy: Policy) -> None:
    view = view_of(policy)
    assert view.tenants == {"search-web"} and view.keys == {"search-1"}
    assert tenant_team(policy, None, "ads-bid") == "ads" and tenant_team(policy, None, "loose") is None
    assert key_tenant(policy, None, "ads-1") == "ads-bid" and key_tenant(policy, None, "nope") is None
    assert view.sees_request({"tenant": "search-web", "key_id": "search-1"})
    assert not view.sees_request({"tenant": "ads-bid"}) and not view.sees_request({"tenant": None})


@pytest.mark.parametrize(
    "scope, subject, seen",
    [
        ("key", "search-1", True),
        ("key", "ads-1", False),
        ("key_model", "search-1/llama-3.1-8b", True),
        ("key_model", "ads-1/llama-3.1-8b", False),
        ("tenant", "search-web", True),
        ("tenant", "loose", False),
        ("user", "search-web/alice", True),
        ("program", "ads-bid/run-1", False),
        ("team", "search", True),
        ("team", "ads", False),
        ("team_provider", "search/anthropic", True),
        ("global", "*", False),  # every team's counter: not a share of it either
        ("model", "llama-3.1-8b", False),
        ("org", "acme", False),
        ("tag", "search-web", False),
        ("key", None, False),
    ],
)
def test_a_limit_counter_is_seen_when_its_subject_is_the_teams(
    policy: Policy, scope: str, subject: str | None, seen: bool
) -> None:
    assert view_of(policy).sees_counter(scope, subject) is seen


def test_an_override_is_seen_when_it_concerns_only_the_team(policy: Policy) -> None:
    view = view_of(policy)
    assert view.sees_override({"rule": "tenant-rpm", "subject": "search-web"})
    assert not view.sees_override({"rule": "tenant-rpm", "subject": "ads-bid"})
    assert not view.sees_override({"rule": "tenant-rpm", "subject": None})  # every tenant's
    assert view.sees_override({"rule": "search-daily-rpm", "subject": None})  # a rule matched to the team
    assert view.sees_override({"rule": "team-daily", "subject": "search"})
    assert not view.sees_override({"rule": "all-rpm", "subject": None})
    assert not view.sees_override({"rule": "no-such-rule", "subject": "search-web"})


def test_an_audit_record_is_seen_when_its_object_is_the_teams_or_the_change_was_its_own(policy: Policy) -> None:
    view = view_of(policy)
    key = {"route": "/admin/keys/{key_id}", "actor": "admin-token", "target": "k9"}
    assert view.sees_change({**key, "before": {"tenant": "search-web"}, "after": None})  # revoked: still its
    assert not view.sees_change({**key, "before": None, "after": {"tenant": "ads-bid"}})
    assert view.sees_change({**key, "target": "search-1", "before": "[too large]"})
    tenant = {"route": "/admin/tenants/{name}", "actor": "admin-token", "target": "new"}
    assert view.sees_change({**tenant, "before": {"team": "ads"}, "after": {"team": "search"}})  # moved in
    assert not view.sees_change({**tenant, "before": {"team": "ads"}, "after": {"team": "ads"}})
    assert view.sees_change({"route": "/admin/overrides", "actor": "loopback",
                             "after": {"rule": "tenant-rpm", "subject": "search-web"}})  # fmt: skip
    assert not view.sees_change({"route": "/admin/reload", "actor": "admin-token", "target": "policies"})
    assert view.sees_change({"route": "/admin/reload", "actor": "user:tom"})  # its own (refused) would not log


def test_csv_cells_that_look_like_formulas_are_quoted() -> None:
    for text in ("=1+1", "+1", "-1+A1", "@SUM(A1)", "\tx", "\rx"):
        assert safe_cell(text) == "'" + text
    assert safe_cell("llama-3.1-8b") == "llama-3.1-8b" and safe_cell(None) == ""
    assert safe_cell(-0.5) == -0.5  # a number is the gateway's own, written as a number
    metrics = dict.fromkeys(METRIC_COLUMNS, 1)
    found = {"by": ["tenant", "user"], "rows": [{"tenant": "t", "user": "=cmd|'/c calc'!A0", **metrics}],
             "total": metrics, "groups": 1}  # fmt: skip
    rows = list(csv.reader(io.StringIO(usage_csv(found))))
    assert rows[0] == ["tenant", "user", *METRIC_COLUMNS]
    assert rows[1][:2] == ["t", "'=cmd|'/c calc'!A0"] and rows[2][:2] == ["TOTAL", ""]


@pytest.mark.redis
async def test_the_live_tail_of_every_replica_keeps_a_team_admins_rows_before_its_limit(
    redis_url: str, redis_prefix: str
) -> None:
    """Two replicas' tails merged through Redis (gateway/console/shared.py): a team admin's `keep` is
    applied to every replica's rows before the limit, so another team's traffic cannot crowd its own out."""
    from gateway.console.activity import ConsoleActivity
    from gateway.console.shared import SharedActivity
    from gateway.request.record import RequestRecord

    policy = Policy(PoliciesConfig())
    now = time.time()
    replicas = []
    for name, tenant in (("a", "search-web"), ("b", "ads-bid")):
        activity = ConsoleActivity(lambda: policy)
        for i in range(30 if tenant == "ads-bid" else 3):
            activity.observe(RequestRecord(request_id=f"{name}{i}", api="chat", started_at_unix_s=now - 1,
                                           duration_s=0.1, tenant=tenant))  # fmt: skip
        replicas.append(SharedActivity(activity, redis_url, redis_prefix, name))
    try:
        for replica in replicas:
            await replica.publish()
        view = build_view(
            "user:tom", frozenset({"search"}), Policy(PoliciesConfig.model_validate(yaml.safe_load(POLICY))), None
        )
        found = await replicas[1].merged(limit=5, keep=view.sees_request)
        assert [row["tenant"] for row in found["tail"]] == ["search-web"] * 3
        assert len((await replicas[1].merged(limit=5))["tail"]) == 5
    finally:
        for replica in replicas:
            await replica.stop()

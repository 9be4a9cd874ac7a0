"""Per-team counters in each minute of the console's last hour (issue 45): a team admin's overview is
its teams' own requests, tokens and dollars, counted by the tenant's team, bounded by the teams of
policies.yaml, summed across replicas like the other counters, and never naming another team."""

from __future__ import annotations

import yaml

from gateway.console.activity import ConsoleActivity, summed, team_overview
from gateway.request.record import RequestRecord
from policies.keys.directory import KeyDirectory
from policies.keys.store import MemoryDirectoryStore
from policies.loader import parse_config
from policies.policy import Policy

POLICY = Policy(
    parse_config(
        yaml.safe_dump(
            {
                "teams": {"search": {}, "ads": {}},
                "tenants": {"web": {"team": "search"}, "bid": {"team": "ads"}, "solo": {}},
                "models": {"m": {}},
            }
        )
    )
)
NOW = 1_800_000_000.0


def record(i: int, tenant: str, **fields: object) -> RequestRecord:
    base = RequestRecord(
        request_id=f"r{i}", api="chat", started_at_unix_s=NOW - 30, duration_s=0.5, tenant=tenant, model="m"
    )
    for name, value in fields.items():
        setattr(base, name, value)
    return base


def test_each_minute_counts_the_requests_tokens_and_dollars_of_each_team() -> None:
    activity = ConsoleActivity(lambda: POLICY, clock=lambda: NOW)
    activity.observe(record(1, "web", prompt_tokens=10, completion_tokens=5, cost_usd=0.25))
    activity.observe(record(2, "web", status="rejected", http_status=429))
    activity.observe(record(3, "bid", prompt_tokens=7, cost_usd=1.0, status="error", http_status=502))
    activity.observe(record(4, "solo", prompt_tokens=100))  # a tenant of no team: in no team's counters
    activity.observe(record(5, "unknown-tenant"))
    teams = activity.minutes()[-1]["teams"]
    assert set(teams) == {"search", "ads"}
    search = teams["search"]
    assert (search["requests"], search["served"], search["rejected"], search["errors"]) == (2, 1, 1, 0)
    assert (search["input_tokens"], search["output_tokens"], search["cost_usd"]) == (10, 5, 0.25)
    assert (teams["ads"]["requests"], teams["ads"]["errors"], teams["ads"]["cost_usd"]) == (1, 1, 1.0)
    assert activity.overview()["summary"]["requests"] == 5  # the fleet's counters count everyone


def test_a_team_admins_overview_is_its_teams_alone_and_names_no_other() -> None:
    activity = ConsoleActivity(lambda: POLICY, clock=lambda: NOW)
    activity.observe(record(1, "web", prompt_tokens=10, completion_tokens=5, cost_usd=0.25))
    activity.observe(record(2, "bid", prompt_tokens=7, cost_usd=1.0))
    own = team_overview(activity.overview()["minutes"], frozenset({"search"}), NOW)
    assert own["summary"]["requests"] == 1 and own["summary"]["error_rate"] == 0.0
    assert sum(m["cost_usd"] for m in own["minutes"]) == 0.25 and len(own["minutes"]) == 60
    assert all("teams" not in m and "team_models" not in m for m in own["minutes"])  # no other team named
    assert own["models"] == ["m"]  # its teams' own per-model counters: search's one request, not ads'
    assert sum(m["models"].get("m", {}).get("requests", 0) for m in own["minutes"]) == 1
    both = team_overview(activity.minutes(), frozenset({"search", "ads"}), NOW)
    assert both["summary"]["requests"] == 2
    none = team_overview(activity.minutes(), frozenset({"nobody"}), NOW)
    assert none["summary"]["requests"] == 0 and none["summary"]["error_rate"] is None


async def test_a_tenant_made_through_the_admin_api_counts_in_its_team() -> None:
    directory = KeyDirectory(MemoryDirectoryStore())
    await directory.start()
    policy = Policy(POLICY.config, directory=directory)
    await directory.create_tenant({"name": "api-made", "team": "ads"}, policy, ["m"])
    activity = ConsoleActivity(lambda: policy, clock=lambda: NOW)
    activity.observe(record(1, "api-made"))
    assert list(activity.minutes()[-1]["teams"]) == ["ads"]
    assert activity.minutes()[-1]["teams"]["ads"]["requests"] == 1


def test_replicas_minutes_sum_team_by_team() -> None:
    one = ConsoleActivity(lambda: POLICY, clock=lambda: NOW)
    two = ConsoleActivity(lambda: POLICY, clock=lambda: NOW)
    one.observe(record(1, "web", cost_usd=0.5))
    two.observe(record(2, "web", cost_usd=0.25))
    two.observe(record(3, "bid"))
    a, b = one.minutes()[-1], two.minutes()[-1]
    merged = {k: summed(a.get(k), v) if k != "t" else v for k, v in b.items()}
    assert merged["teams"]["search"]["requests"] == 2 and merged["teams"]["search"]["cost_usd"] == 0.75
    assert merged["teams"]["ads"]["requests"] == 1
    own = team_overview([merged], frozenset({"search"}), NOW)
    assert own["summary"]["requests"] == 2
    assert sum(m["models"].get("m", {}).get("requests", 0) for m in own["minutes"]) == 2  # both replicas' per model

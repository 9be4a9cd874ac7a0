"""The run-budget part of the agents benchmark, its pure parts: the rounds it plans, the policy it
loads into the gateways, and a report that finds a run over its cap and counters that disagree."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from bench.agents.budgets import CAPS, RunResult, plan_round, policy
from bench.agents.budgets_report import summarize, totals, write
from bench.agents.workload import Session, Turn
from policies.loader import parse_config


def sessions() -> list[Session]:
    return [
        Session("a", tuple(Turn(5300 + 100 * i, 90) for i in range(8))),
        Session("b", tuple(Turn(5200 + 150 * i, 120) for i in range(3))),
    ]


def test_a_round_is_a_third_of_its_runs_per_cap_seeded_and_staggered() -> None:
    plans = plan_round(sessions(), seed=7, programs=12, turns=5, stagger_s=10.0)
    assert [p.tenant for p in plans[:3]] == list(CAPS)
    assert {t: sum(p.tenant == t for p in plans) for t in CAPS} == dict.fromkeys(CAPS, 4)
    assert all(len(p.session.turns) <= 5 and 0.0 <= p.start_s <= 10.0 for p in plans)
    assert len({p.name for p in plans}) == 12 and {p.first_gateway for p in plans} <= {0, 1}
    assert plans == plan_round(sessions(), seed=7, programs=12, turns=5, stagger_s=10.0)
    other = plan_round(sessions(), seed=8, programs=12, turns=5, stagger_s=10.0)
    assert not {p.name for p in plans} & {p.name for p in other}  # rounds' runs are distinct runs


def test_the_benchmark_policy_loads_and_gives_each_tenant_its_cap() -> None:
    config = parse_config(yaml.safe_dump(policy()))
    assert set(config.tenants) == set(CAPS)
    tight = [r for r in policy()["limits"] + policy()["budgets"] if "match" in r]
    assert {r["match"]["tenant"]: next(k for k in r if k.endswith("_per_run")) for r in tight} == {
        t: dim for t, (dim, _) in CAPS.items()
    }


def run(
    name: str, tenant: str, spent: float, *, ledger: float | None = None, client: float | None = None
) -> dict[str, Any]:
    """A run whose binding counter holds `spent` (its ledger and client the same unless told)."""
    dimension, cap = CAPS[tenant]
    r = RunResult(name, tenant, "a", dimension, cap, sent=40, served=30, refused=10, refused_turns=1)
    r.first_refused_turn = 1
    field = {"usd_per_run": "usd", "tokens_per_run": "tokens", "calls_per_run": "calls"}[dimension]
    r.counter = {dimension: spent}
    r.loose = {d: 1.0 for d in ("usd_per_run", "tokens_per_run", "calls_per_run") if d != dimension}
    r.ledger = {"usd": 1.0, "tokens": 1.0, "calls": 1.0, "records": 40.0}
    r.ledger[field] = spent if ledger is None else ledger
    r.client_usd, r.client_tokens, r.served = 1.0, 1, 1
    if dimension == "usd_per_run":
        r.client_usd = spent if client is None else client
    elif dimension == "tokens_per_run":
        r.client_tokens = int(spent if client is None else client)
    else:
        r.served = int(spent if client is None else client)
    r.refusal_codes = {"rate_limit_exceeded:run cap": 10}
    return asdict(r)


def test_the_report_finds_the_run_over_its_cap_and_the_counter_the_ledger_disagrees_with(tmp_path: Path) -> None:
    usd_cap, token_cap, call_cap = (CAPS[t][1] for t in ("usd", "tokens", "calls"))
    raw: dict[str, Any] = {
        "args": {"seeds": "1,2", "programs": 3, "width": 20, "turns": 5, "stagger_s": 10.0, "time_scale": 20.0},
        "machine": "test",
        "pool": {"engines": 2, "max_num_seqs": 64, "preset": "llama-3.1-8b@h100", "replicas": 2},
        "price": {"input_per_mtok": 1.0, "output_per_mtok": 4.0},
        "caps": {t: list(c) for t, c in CAPS.items()},
        "rounds": {
            "1": [
                run("r1-usd-0", "usd", usd_cap - 0.002),
                run("r1-tokens-1", "tokens", token_cap - 900),
                run("r1-calls-2", "calls", call_cap),  # exactly at the cap: not over it
            ],
            "2": [
                run("r2-usd-0", "usd", usd_cap - 0.001, ledger=usd_cap + 0.004),  # the ledger saw more
                run("r2-tokens-1", "tokens", token_cap - 100),
                run("r2-calls-2", "calls", call_cap - 1),
            ],
        },
    }
    summary = summarize(raw)
    assert summary["usd"]["runs_over"] == 1 and abs(summary["usd"]["overshoot_max"] - 0.004) < 1e-9
    assert abs(summary["usd"]["counter_vs_ledger_max"]["usd_per_run"] - 0.005) < 1e-9
    assert summary["tokens"]["runs_over"] == 0 and summary["tokens"]["overshoot_max"] == -100
    assert summary["calls"]["runs_over"] == 0 and summary["calls"]["overshoot_max"] == 0
    assert summary["tokens"]["unspent_p50"] == 500 and summary["calls"]["refused"] == 20
    assert totals(raw)["calls_per_run"]["counters"] == call_cap * 2 - 1 + 4  # the loose counters count too
    out = tmp_path / "agents-run-budgets.md"
    write(raw, out)
    text = out.read_text()
    assert "**1 of 6 runs spent past their cap: misses the target of 0.**" in text
    assert (tmp_path / "agents-run-budgets.png").stat().st_size > 0

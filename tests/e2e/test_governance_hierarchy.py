"""Organisation, team, tag and agent-run budgets through three real gateways sharing one Redis:
under concurrent load from two tenants of one team, the team's budget, a tag's budget and an agent
run's budget are never overrun, and each counter equals the cost of what was served (the ledger's
exactness promise, held across replicas); malformed tags are a 400 in OpenAI's shape; the ledger
records tags and `usage report --by tag` attributes spend to each."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from policies.policy import hash_key
from tests.policies.limits.redis_proc import RedisProcess
from tests.support.procs import OTHER_KEY, TEST_KEY, Gateway, running, start_gateway, start_sim, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.timeout(300)]

MODEL = "llama-3.1-8b"
IN_USD, OUT_USD = 100.0 / 1e6, 300.0 / 1e6
MAX_TOKENS = 16
TEAM_USD = 0.25
TAG_USD = 0.08
RUN_USD = 0.05


def policies() -> dict[str, Any]:
    return {
        "orgs": {"acme": {}},
        "teams": {"search": {"org": "acme"}},
        "tenants": {"web": {"team": "search"}, "app": {"team": "search"}},
        "keys": [
            {"id": "k-web", "tenant": "web", "sha256": hash_key(TEST_KEY)},
            {"id": "k-app", "tenant": "app", "sha256": hash_key(OTHER_KEY)},
        ],
        "models": {
            MODEL: {
                "context_length": 16384,
                "default_max_tokens": MAX_TOKENS,
                "price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0},
            }
        },
        "limits": [{"scope": "key", "max_concurrent": 1000}],
        "budgets": [
            {"scope": "team", "usd_per_day": TEAM_USD},
            {"scope": "org", "usd_per_month": 1000.0},
            {"scope": "tag", "match": {"tag": "feature-x"}, "usd_per_day": TAG_USD},
            {"scope": "program", "usd_per_run": RUN_USD},
        ],
        "admission": {"replicas": 3, "store_failure": "fail_closed"},
    }


def test_three_gateways_hold_team_tag_and_run_budgets_exactly(tmp_path: Path, own_redis: RedisProcess) -> None:
    engines = start_sim(tmp_path, count=1, served_model_name=MODEL, time_scale=50.0)
    state = {"backend": "redis", "redis_url": own_redis.url, "redis_timeout_s": 10.0}

    def gateway(i: int) -> Gateway:
        pools = [static_pool("llama", MODEL, engines.urls)]
        ledger = {"dir": str(tmp_path / "ledger"), "file_prefix": f"gw{i}", "commit_interval_ms": 10}
        return start_gateway(tmp_path / f"gw{i}", pools=pools, policies=policies(), state=state, ledger=ledger)

    with running(engines), ThreadPoolExecutor(3) as pool:
        gateways = list(pool.map(gateway, range(3)))
        with running(*gateways):
            bad = openai.OpenAI(base_url=gateways[0].base_url, api_key=TEST_KEY, max_retries=0)
            with pytest.raises(openai.BadRequestError) as info:
                bad.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers={"x-tokenway-tags": "ok, not ok!"},
                )
            assert info.value.body is not None and "invalid tag" in str(info.value.body)
            # 20 parallel turns of one agent run (one tenant: runs are per tenant), over three replicas
            run = asyncio.run(
                _load([g.base_url for g in gateways], program="run-7", clients=20, requests=1, one_key=True)
            )
            tagged = asyncio.run(_load([g.base_url for g in gateways], tags="feature-x", clients=30, requests=2))
            team = asyncio.run(_load([g.base_url for g in gateways], clients=60, requests=4))
            standing = httpx.get(
                gateways[2].base_url + "/key",
                params={"program": "run-7"},
                headers={"Authorization": f"Bearer {TEST_KEY}"},
                timeout=30,
            ).json()["data"]
    for results, cap in ((run, RUN_USD), (tagged, TAG_USD)):
        served = [cost for status, cost in results if status == 200]
        assert served and any(status == 429 for status, _ in results), results
        assert sum(served) <= cap + 1e-9  # never beyond the cap, across three replicas
    every = [cost for results in (run, tagged, team) for status, cost in results if status == 200]
    assert sum(every) <= TEAM_USD + 1e-9
    assert {status for results in (run, tagged, team) for status, _ in results} <= {200, 429}
    redis = own_redis.client()
    spent = {}
    for name in redis.scan_iter(match="*:u:*"):
        key = name.decode()
        raw = redis.hget(name, "s")
        spent[key] = float(raw) if raw is not None else 0.0
    team_spent = next(v for k, v in spent.items() if "|usd_per_day|search" in k)
    assert team_spent == pytest.approx(sum(every), abs=1e-9)  # settled to what was served, nothing reserved
    run_spent = next(v for k, v in spent.items() if "|usd_per_run|web/run-7" in k)
    assert run_spent == pytest.approx(sum(c for s, c in run if s == 200), abs=1e-9)
    (row,) = [r for r in standing["limits"] if r["dimension"] == "usd_per_run"]  # /v1/key?program= on another replica
    assert (standing["program"], row["subject"], row["limit"]) == ("run-7", "web/run-7", RUN_USD)
    assert row["used"] == pytest.approx(run_spent, abs=1e-6)
    argv = [sys.executable, "-m", "gateway.app.cli", "usage", "report", "--by", "tag", "--format", "json"]
    argv += ["--dir", str(tmp_path / "ledger")]
    report = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert report.returncode == 0, report.stderr
    doc = json.loads(report.stdout)
    rows = {row["tag"]: row for row in doc["groups"]}
    tagged_cost = sum(c for s, c in tagged if s == 200)
    assert rows["feature-x"]["cost_usd"] == pytest.approx(tagged_cost, abs=1e-6)
    assert rows[""]["cost_usd"] == pytest.approx(sum(every) - tagged_cost, abs=1e-6)  # untagged
    assert doc["total"]["cost_usd"] == pytest.approx(sum(every), abs=1e-6)


async def _load(
    base_urls: list[str],
    *,
    clients: int,
    requests: int,
    program: str | None = None,
    tags: str | None = None,
    one_key: bool = False,
) -> list[tuple[int, float]]:
    """(status, cost the gateway reported) of each request; both tenants' keys, round-robin over gateways."""
    out: list[tuple[int, float]] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": MAX_TOKENS}

    async def one(i: int, session: aiohttp.ClientSession) -> None:
        headers = {"Authorization": f"Bearer {TEST_KEY if one_key or i % 2 else OTHER_KEY}"}
        if program is not None:
            headers["x-tokenway-program"] = program
        if tags is not None:
            headers["x-tokenway-tags"] = tags
        for j in range(requests):
            url = base_urls[(i + j) % len(base_urls)] + "/chat/completions"
            async with session.post(url, json=body, headers=headers) as response:
                await response.read()
                out.append((response.status, float(response.headers.get("x-tokenway-cost-usd", "0"))))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(one(i, session) for i in range(clients)))
    return out


def test_a_budget_rule_falls_back_to_its_own_cheaper_model(tmp_path: Path) -> None:
    """The big model has no fallback chain; the team's budget on it names `small`: once spent, requests
    are served by small with the fallback header, and a tenant without fallbacks gets the 429."""
    doc = policies()
    doc["models"]["small"] = {"context_length": 16384, "default_max_tokens": 16, "price": {"output_per_mtok": 1.0}}
    doc["tenants"]["app"]["allow_fallback"] = False
    doc["budgets"] = [
        {"scope": "key_model", "match": {"team": "search", "model": MODEL}, "usd_per_day": 0.01, "fallback": "small"}
    ]
    doc.pop("admission")
    big = start_sim(tmp_path, count=1, served_model_name=MODEL, time_scale=50.0)
    small = start_sim(tmp_path, count=1, served_model_name="small", time_scale=50.0)
    with running(big, small):
        pools = [static_pool("big", MODEL, big.urls), static_pool("small", "small", small.urls)]
        gw = start_gateway(tmp_path / "gw", pools=pools, policies=doc)
        with running(gw):
            web = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0)
            served: list[str] = []
            for _ in range(6):  # ~$0.006 each: the second or third no longer fits $0.01
                raw = web.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS
                )
                served.append(raw.parse().model)
            assert served[0] == MODEL and served[-1] == "small", served
            assert raw.headers["x-tokenway-fallback"].startswith(f"{MODEL}->small")
            strict = openai.OpenAI(base_url=gw.base_url, api_key=OTHER_KEY, max_retries=0)
            strict.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16)
            with pytest.raises(openai.RateLimitError):
                for _ in range(4):
                    strict.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS
                    )

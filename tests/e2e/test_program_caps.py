"""An agent run's wall-clock cap and the live runs' spend, through real gateways: two `tokenway serve`
sharing one Redis hold a run to `seconds_per_run` (and to the lower `x-tokenway-run-seconds`) whichever
replica it calls, `/v1/key?program=` on the other replica shows when the run started and the seconds
it has left, `GET /admin/programs` on either lists the live runs with what each spent (a team admin
its teams' runs only), and the console's Programs page shows them in Debian's headless Chromium.

No sleep stands for time passing: a run that started long ago is one whose clock (the bucket the
first admitted call writes, policies/limits/plan.py `CLOCK_RATE_PER_S`) is written into Redis as
that call would have written it then."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from policies.policy import hash_key
from tests.e2e.test_console import by_css, page_ready, wait
from tests.policies.limits.redis_proc import RedisProcess
from tests.support.browser import chromium, require_browser
from tests.support.polling import wait_for
from tests.support.procs import OTHER_KEY, TEST_KEY, Gateway, SimEngines, running, start_gateway, start_sim, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "llama-3.1-8b"
ADMIN = "program-caps-admin-token"
TEAM_TOKEN = "program-caps-team-admin-token"
CAP_S = 600


def policies() -> dict[str, Any]:
    return {
        "teams": {"search": {}, "ads": {}},
        "tenants": {"web": {"team": "search"}, "app": {"team": "ads"}},
        "keys": [
            {"id": "k-web", "tenant": "web", "sha256": hash_key(TEST_KEY)},
            {"id": "k-app", "tenant": "app", "sha256": hash_key(OTHER_KEY)},
        ],
        "models": {MODEL: {"context_length": 16384, "price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}},
        "limits": [{"scope": "program", "calls_per_run": 50, "tokens_per_run": 100_000, "seconds_per_run": CAP_S}],
        "budgets": [{"scope": "program", "usd_per_run": 1.0}],
    }


def server() -> dict[str, Any]:
    digest = hashlib.sha256(TEAM_TOKEN.encode()).hexdigest()
    return {"admin_token": ADMIN, "users": [{"name": "tom", "role": "team_admin", "teams": ["ads"],
                                             "tokens_sha256": [digest]}]}  # fmt: skip


def call(gateway: Gateway, program: str, *, key: str = TEST_KEY, **headers: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
    return httpx.post(
        gateway.base_url + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}", "x-tokenway-program": program, **headers},
        timeout=30,
    )


def start_clock(redis: Any, program: str, ago_s: float, tenant: str = "web") -> None:
    """The run's clock as its first admitted call would have written it `ago_s` seconds ago."""
    seconds, micros = redis.time()
    redis.hset(f"{{tokenway}}:b:@run-clock|seconds_per_run|{tenant}/{program}", mapping={"u": "0",
               "t": repr(seconds + micros / 1e6 - ago_s)})  # fmt: skip


def programs(gateway: Gateway, token: str = ADMIN, **params: str) -> list[dict[str, Any]]:
    answer = httpx.get(
        gateway.url + "/admin/programs", params=params, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    data: list[dict[str, Any]] = answer.json()["data"]
    return data


@pytest.mark.redis
def test_two_gateways_hold_a_runs_wall_clock_and_list_the_live_runs(tmp_path: Path, own_redis: RedisProcess) -> None:
    engines = start_sim(tmp_path, count=1, served_model_name=MODEL, time_scale=50.0)
    state = {"backend": "redis", "redis_url": own_redis.url, "redis_timeout_s": 10.0}

    def gateway(i: int) -> Gateway:
        pools = [static_pool("llama", MODEL, engines.urls)]
        return start_gateway(tmp_path / f"gw{i}", pools=pools, policies=policies(), state=state, server=server())

    redis = own_redis.client()
    with running(engines), ThreadPoolExecutor(2) as pool:
        one, two = pool.map(gateway, range(2))
        with running(one, two):
            start_clock(redis, "old", CAP_S + 5)  # began ten minutes and more ago
            refused = call(one, "old")
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert "wall-clock seconds per agent run" in error["message"] and "agent run 'old'" in error["message"]
            assert error["code"] == "rate_limit_exceeded" and refused.headers["x-should-retry"] == "false"
            assert "retry-after" not in refused.headers
            assert call(two, "old").status_code == 429  # the other replica reads the same clock

            assert call(one, "fresh").status_code == 200  # starts its clock now
            assert call(two, "fresh").status_code == 200
            standing = httpx.get(
                two.base_url + "/key",
                params={"program": "fresh"},
                headers={"Authorization": f"Bearer {TEST_KEY}"},
                timeout=30,
            ).json()["data"]
            (clock,) = [r for r in standing["limits"] if r["dimension"] == "seconds_per_run"]
            assert clock["started_at"] is not None and CAP_S - 60 < clock["seconds_left"] <= CAP_S
            assert (clock["limit"], clock["subject"], clock["reset_s"]) == (CAP_S, "web/fresh", None)

            start_clock(redis, "short", 100)
            lowered = call(one, "short", **{"x-tokenway-run-seconds": "50"})
            assert lowered.status_code == 429 and "Limit 50s" in lowered.json()["error"]["message"]
            assert call(two, "short").status_code == 200  # the policy's 600 s still hold for it
            assert call(one, "short", **{"x-tokenway-run-seconds": "soon"}).status_code == 400
            assert call(one, "app-run", key=OTHER_KEY).status_code == 200

            runs = {r["program"]: r for r in programs(two, sort="recent")}
            assert set(runs) == {"fresh", "short", "app-run"}  # a run never admitted ("old") has no entry
            fresh = runs["fresh"]
            assert (fresh["tenant"], fresh["key_id"], fresh["model"], fresh["calls"]) == ("web", "k-web", MODEL, 2)
            assert fresh["spent_usd"] > 0 and fresh["tokens"] > 0
            assert CAP_S - 60 < fresh["seconds_left"] <= CAP_S
            assert {c["dimension"] for c in fresh["caps"]} == {
                "calls_per_run",
                "tokens_per_run",
                "seconds_per_run",
                "usd_per_run",
            }
            assert runs["short"]["seconds_left"] == pytest.approx(CAP_S - 100, abs=30)
            by_spend = programs(one, sort="spend", limit="1")
            assert len(by_spend) == 1 and by_spend[0]["program"] == "fresh"  # two calls outspend one
            assert [r["program"] for r in programs(one, tenant="app")] == ["app-run"]
            assert [r["program"] for r in programs(one, token=TEAM_TOKEN)] == ["app-run"]  # team ads only
            bad = httpx.get(
                one.url + "/admin/programs", params={"limit": "0"}, headers={"Authorization": f"Bearer {ADMIN}"}
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_the_console_lists_live_programs(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    require_browser()
    engines = sim_factory(count=1, time_scale=50, served_model_name=MODEL)
    gateway = gateway_factory(pools=[static_pool("p", MODEL, engines.urls)], policies=policies(), server=server())
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    for _ in range(2):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            extra_headers={"x-tokenway-program": "ticket-4711"},
        )
    assert programs(gateway)[0]["calls"] == 2
    with chromium() as driver:
        driver.get(gateway.url + "/ui")
        wait(driver, by_css("#token")).send_keys(ADMIN)
        wait(driver, by_css("#login-submit")).click()
        wait(driver, by_css("#nav"))
        driver.get(gateway.url + "/ui#programs")
        wait(driver, page_ready("programs"))
        row = wait(driver, by_css('#programs-table tr[data-id="web/ticket-4711"]'))
        text = row.text
        assert "k-web" in text and MODEL in text and "$" in text
        assert "calls_per_run: 48 left of 50" in text and "seconds_per_run:" in text
        driver.get(gateway.url + "/ui#limits")  # a run's caps (no reset) on the Limits page too
        wait(driver, page_ready("limits"))
        table = wait(driver, by_css("#limits-table"))
        assert "seconds_per_run" in table.text and "calls_per_run" in table.text
        errors = [e.text for e in driver.find_elements("css selector", "#page .error") if e.text]
        assert not errors, errors


def test_a_run_no_run_rule_counts_is_listed_from_the_ledger(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    """Without a `scope: program` rule a run has no counters: its row comes from the ledger's records
    (docs/agents.md#live-programs-in-the-console), with its spend and no caps; a team admin still sees
    its teams' runs only."""
    engines = sim_factory(count=1, time_scale=50, served_model_name=MODEL)
    doc = {k: v for k, v in policies().items() if k not in ("limits", "budgets")}
    gateway = gateway_factory(pools=[static_pool("p", MODEL, engines.urls)], policies=doc, server=server())
    assert call(gateway, "untracked").status_code == 200
    assert call(gateway, "untracked").status_code == 200
    assert call(gateway, "app-side", key=OTHER_KEY).status_code == 200
    ledger = gateway.workdir / "var" / "usage"
    wait_for(
        lambda: sum(path.read_bytes().count(b"\n") for path in ledger.glob("*.jsonl")) >= 3,
        what="the three records in the ledger",
    )
    runs = {r["program"]: r for r in programs(gateway)}
    assert set(runs) == {"untracked", "app-side"}
    run = runs["untracked"]
    assert (run["source"], run["tenant"], run["key_id"], run["model"], run["calls"]) == (
        "ledger",
        "web",
        "k-web",
        MODEL,
        2,
    )
    assert run["spent_usd"] > 0 and run["tokens"] > 0 and run["caps"] == [] and run["seconds_left"] is None
    assert run["started_at"] <= run["last_seen"]
    assert [r["program"] for r in programs(gateway, token=TEAM_TOKEN)] == ["app-side"]  # team ads only
    assert [r["program"] for r in programs(gateway, tenant="web")] == ["untracked"]
    # the run's own caller reads the same from /v1/key?program= (its tenant's run only)
    own = httpx.get(
        gateway.base_url + "/key", params={"program": "untracked"}, headers={"Authorization": f"Bearer {TEST_KEY}"}
    ).json()["data"]
    assert own["program_spend"]["calls"] == 2 and own["program_spend"]["usd"] == pytest.approx(run["spent_usd"])
    assert own["program_spend"]["source"] == "ledger-files"
    other = httpx.get(
        gateway.base_url + "/key", params={"program": "untracked"}, headers={"Authorization": f"Bearer {OTHER_KEY}"}
    ).json()["data"]
    assert other["program_spend"]["calls"] == 0  # another tenant's run of the same name is not its own

"""Temporary overrides through the admin API on two real gateways sharing one Redis: a team's spent
budget raised on one gateway admits again on the other, ends by itself at its time, and a deleted
override ends at once; bad overrides are 4xx in OpenAI's shape; every change is in the audit log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from policies.policy import hash_key
from tests.policies.limits.redis_proc import RedisProcess
from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, running, start_gateway, start_sim, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.timeout(240)]

MODEL = "llama-3.1-8b"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


def policies() -> dict[str, Any]:
    return {
        "orgs": {"acme": {}},
        "teams": {"search": {"org": "acme"}},
        "tenants": {"web": {"team": "search"}},
        "keys": [{"id": "k-web", "tenant": "web", "sha256": hash_key(TEST_KEY)}],
        "models": {MODEL: {"default_max_tokens": 16, "price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}},
        "budgets": [{"id": "team-daily", "scope": "team", "usd_per_day": 0.008}],  # about one request
    }


def chat(gw: Gateway) -> int:
    response = httpx.post(
        gw.base_url + "/chat/completions", json=BODY, headers={"Authorization": f"Bearer {TEST_KEY}"}, timeout=30
    )
    return response.status_code


def admin(gw: Gateway, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, gw.url + path, json=body, timeout=30)


def test_an_override_raises_a_spent_budget_on_every_replica_until_it_ends(
    tmp_path: Path, own_redis: RedisProcess
) -> None:
    engines = start_sim(tmp_path, count=1, served_model_name=MODEL, time_scale=50.0)
    state = {"backend": "redis", "redis_url": own_redis.url, "redis_timeout_s": 10.0}
    with running(engines):
        pools = [static_pool("llama", MODEL, engines.urls)]
        gateways = [start_gateway(tmp_path / f"gw{i}", pools=pools, policies=policies(), state=state) for i in (0, 1)]
        with running(*gateways):
            one, other = gateways
            statuses = [chat(one) for _ in range(3)]
            assert statuses[0] == 200 and statuses[-1] == 429, statuses
            assert chat(other) == 429  # the team's budget is shared

            bad = admin(
                one, "POST", "/admin/overrides", {"rule": "nope", "dimension": "usd_per_day", "value": 1, "for": "1h"}
            )
            assert bad.status_code == 404 and "team-daily" in bad.json()["error"]["message"]
            for body in (
                {"rule": "team-daily", "dimension": "rpm", "value": 1, "for": "1h"},  # the rule sets no rpm
                {"rule": "team-daily", "dimension": "usd_per_day", "value": 1},  # no end
                {"rule": "team-daily", "dimension": "usd_per_day", "value": 1, "for": "400d"},
                {"rule": "team-daily", "dimension": "usd_per_day", "value": -1, "for": "1h"},
            ):
                refused = admin(one, "POST", "/admin/overrides", body)
                assert refused.status_code == 400, (body, refused.text)
                assert refused.json()["error"]["type"] == "invalid_request_error"

            made = admin(
                one,
                "POST",
                "/admin/overrides",
                {"rule": "team-daily", "subject": "search", "dimension": "usd_per_day", "value": 10.0, "for": "1h",
                 "reason": "launch day"},
            )  # fmt: skip
            assert made.status_code == 201, made.text
            override = made.json()
            assert override["active"] and override["rule"] == "team-daily"
            assert chat(one) == 200
            wait_for(lambda: chat(other) == 200, timeout_s=10, what="the override to reach the other replica")
            listed = admin(other, "GET", "/admin/overrides").json()["data"]
            assert [o["id"] for o in listed] == [override["id"]]

            assert admin(other, "DELETE", f"/admin/overrides/{override['id']}").status_code == 200
            wait_for(lambda: chat(one) == 429, timeout_s=10, what="the deleted override to end on both")
            assert admin(one, "DELETE", f"/admin/overrides/{override['id']}").status_code == 404

            short = admin(
                one,
                "POST",
                "/admin/overrides",
                {"rule": "team-daily", "dimension": "usd_per_day", "value": 10, "for": "3s"},
            )
            assert short.status_code == 201
            assert chat(one) == 200
            wait_for(lambda: chat(one) == 429, timeout_s=30, what="the override to end by itself")
            audit = [r for gw in gateways for r in admin(gw, "GET", "/admin/audit?action=overrides").json()["data"]]
            assert {(r["method"], r["target"]) for r in audit} >= {
                ("POST", override["id"]),
                ("DELETE", override["id"]),
                ("POST", short.json()["id"]),
            }, json.dumps(audit)[:2000]

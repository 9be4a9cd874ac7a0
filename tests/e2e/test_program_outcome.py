"""Cost per outcome against a real gateway and simulated engine: programs run, their clients post how
each ended (`POST /v1/programs/{id}/outcome`, once), and `tokenway usage report --by outcome` divides
what each tenant's successful programs cost by their successes and their value."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from policies.policy import hash_key
from tests.support.polling import wait_for
from tests.support.procs import OTHER_KEY, REPO, TEST_KEY, Gateway, SimEngines, metric_total, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

LLAMA = "llama-3.1-8b"
POLICY: dict[str, Any] = {
    "tenants": {"t1": {}, "t2": {}},
    "keys": [
        {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
        {"id": "k2", "tenant": "t2", "sha256": hash_key(OTHER_KEY)},
    ],
    "models": {LLAMA: {"price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}},
}


@pytest.fixture
def gateway(sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]) -> Gateway:
    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    return gateway_factory(pools=[static_pool("p", LLAMA, engines.urls)], policies=POLICY)


def post(gw: Gateway, program: str, body: Any, key: str = TEST_KEY) -> httpx.Response:
    return httpx.post(
        f"{gw.base_url}/programs/{program}/outcome", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10
    )


def run_program(client: openai.OpenAI, program: str, calls: int) -> float:
    """`calls` requests of one program; what they cost (the header's figure)."""
    cost = 0.0
    for i in range(calls):
        raw = client.chat.completions.with_raw_response.create(
            model=LLAMA,
            messages=[{"role": "user", "content": f"step {i}"}],
            max_tokens=8,
            extra_headers={"x-tokenway-program": program},
        )
        cost += float(raw.headers["x-tokenway-cost-usd"])
    return cost


def report(gw: Gateway) -> list[dict[str, Any]]:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "gateway.ledger.cli", "usage", "report", "--by", "outcome"),
            *("--format", "json", "--dir", str(Path(gw.workdir, "var", "usage")), "--progress", "off"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    groups: list[dict[str, Any]] = json.loads(out.stdout)["groups"]
    return groups


def test_outcomes_once_per_program_and_the_cost_per_success(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    won = run_program(client, "run-1", 3)
    lost = run_program(client, "run-2", 2)
    open_cost = run_program(client, "run-3", 1)  # never reports

    ok = post(gateway, "run-1", {"success": True, "value": 4})
    assert ok.status_code == 201, ok.text
    assert ok.json() == {"object": "program.outcome", "program": "run-1", "success": True, "value": 4.0}
    assert post(gateway, "run-2", {"success": False}).status_code == 201
    again = post(gateway, "run-1", {"success": False})
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "outcome_exists" and again.json()["error"]["type"]
    assert post(gateway, "run-1", {"success": True}, key=OTHER_KEY).status_code == 201  # t2's own run-1

    for bad, param in (
        ({"value": 1}, "success"),
        ({"success": "yes"}, "success"),
        ({"success": True, "value": "x"}, "value"),
    ):
        refused = post(gateway, "run-9", bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert post(gateway, "run-9", {"success": True, "extra": 1}).status_code == 400
    assert post(gateway, "run-9", {"success": True}, key="sk-nobody").status_code == 401
    assert post(gateway, "run-9", [1, 2]).status_code == 400

    def t1_row() -> dict[str, Any] | None:
        rows = [r for r in report(gateway) if r["tenant"] == "t1" and r["model"] == LLAMA]
        return rows[0] if rows and rows[0]["programs"] == 2 and rows[0]["no_outcome_cost_usd"] > 0 else None

    # the metrics: each run's calls and dollars under its id, outcomes per tenant and result
    wait_for(
        lambda: metric_total(gateway.url, "tokenway_program_calls_total", tenant="t1", program="run-3") == 1,
        what="the runs' calls on /metrics",
        timeout_s=10,
    )
    assert metric_total(gateway.url, "tokenway_program_calls_total", tenant="t1", program="run-1") == 3
    assert metric_total(gateway.url, "tokenway_program_cost_usd_total", tenant="t1", program="run-2") == pytest.approx(
        lost, abs=1e-9
    )
    assert metric_total(gateway.url, "tokenway_program_outcomes_total", tenant="t1", success="true") == 1
    assert metric_total(gateway.url, "tokenway_program_outcomes_total", tenant="t1", success="false") == 1
    assert metric_total(gateway.url, "tokenway_program_outcome_value_total", tenant="t1") == 4

    row = wait_for(t1_row, timeout_s=15)
    assert row is not None
    assert row["succeeded"] == 1 and row["value"] == 4.0
    assert row["cost_usd"] == pytest.approx(won + lost, abs=1e-9)
    assert row["cost_per_success_usd"] == pytest.approx(won + lost, abs=1e-9)
    assert row["cost_per_value_usd"] == pytest.approx((won + lost) / 4, abs=1e-9)
    assert row["no_outcome_cost_usd"] == pytest.approx(open_cost, abs=1e-9)
    assert row["cpm_usd"] > 0

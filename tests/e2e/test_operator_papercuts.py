"""What a new operator meets, against a real gateway process and simulated engines: `tokenway pools
status` finds the gateway through $TOKENWAY_URL and tells a refused admin token from an unreachable
gateway, and a non-streamed answer says what it cost (`x-tokenway-cost-usd`, the ledger's figure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.support.polling import wait_for
from tests.support.procs import REPO, TEST_KEY, Gateway, SimEngines, free_port, policies_doc, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

LLAMA = "llama-3.1-8b"
ADMIN_TOKEN = "papercuts-admin-token-5b1f0e7c9d"
POLICY = policies_doc(models={LLAMA: {"price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}})


@pytest.fixture
def gateway(sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]) -> Gateway:
    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    return gateway_factory(
        pools=[static_pool("p", LLAMA, engines.urls)], policies=POLICY, server={"admin_token": ADMIN_TOKEN}
    )


def pools_status(url: str, token: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENWAY_URL", "TOKENWAY_ADMIN_TOKEN")}
    env["TOKENWAY_URL"] = url
    if token is not None:
        env["TOKENWAY_ADMIN_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "pools", "status", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_pools_status_honours_tokenway_url_and_names_a_refused_token(gateway: Gateway) -> None:
    ok = pools_status(gateway.url, ADMIN_TOKEN)
    assert ok.returncode == 0, ok.stderr
    assert [pool["name"] for pool in json.loads(ok.stdout)["pools"]] == ["p"]
    refused = pools_status(gateway.url, "not-the-admin-token")
    assert refused.returncode == 1
    assert "401" in refused.stderr and "--admin-token" in refused.stderr, refused.stderr
    assert "cannot reach" not in refused.stderr
    nobody = pools_status(f"http://127.0.0.1:{free_port()}", ADMIN_TOKEN)
    assert nobody.returncode == 1 and "cannot reach" in nobody.stderr


def test_a_non_streamed_answer_says_what_it_cost(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=LLAMA, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8
    )
    reply = raw.parse()
    cost = float(raw.headers["x-tokenway-cost-usd"])
    assert reply.usage is not None
    assert cost == pytest.approx((reply.usage.prompt_tokens * 100 + reply.usage.completion_tokens * 300) / 1e6)
    request_id = raw.headers["x-request-id"]

    def recorded() -> float | None:
        for path in sorted(Path(gateway.workdir, "var", "usage").glob("*.jsonl")):
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                if entry.get("request_id") == request_id:
                    return float(entry["cost_usd"])
        return None

    assert wait_for(recorded, timeout_s=10) == pytest.approx(cost, abs=1e-9)  # the ledger's figure

"""A batch created by a key made through the admin API runs to completion and is billed to that key,
in memory and in Redis state: the runner finds the key where a request finds it (the key directory),
not only in policies.yaml. Real gateway processes, simulated engines, the official openai client."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.e2e.test_batch import FINISHED, MODEL, batch_section, chat_lines, ledger, policies, pools, rows
from tests.support.procs import Gateway, SimEngines

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def admin(gateway: Gateway, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        gateway.url + path,
        data=json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("state", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_batch_of_an_api_made_key_completes_and_is_billed_to_it(
    state: str,
    request: pytest.FixtureRequest,
    sim_factory: Callable[..., SimEngines],
    gateway_factory: Callable[..., Gateway],
) -> None:
    sections: dict[str, Any] = {}
    if state == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
        sections["state"] = {"backend": "redis", "redis_url": url, "key_prefix": prefix}
    engines = sim_factory(count=1, time_scale=20.0, served_model_name=MODEL)
    gateway = gateway_factory(
        pools=pools(engines.urls),
        policies=policies(),
        batch=batch_section(),
        ledger={"commit_interval_ms": 10},
        **sections,
    )
    # loopback, no admin token: the admin API answers (a key of a policies.yaml tenant and one of a
    # tenant made through the API too)
    status, tenant = admin(gateway, "POST", "/admin/tenants", {"name": "acme"})
    assert status == 201, tenant
    for tenant_name, key_id in (("t1", "minted-file-tenant"), ("acme", "minted-api-tenant")):
        status, made = admin(gateway, "POST", "/admin/keys", {"tenant": tenant_name, "id": key_id})
        assert status == 201, made
        c = openai.OpenAI(base_url=gateway.base_url, api_key=made["secret"], max_retries=0, timeout=30)
        file = c.files.create(file=("in.jsonl", chat_lines(4)), purpose="batch")
        batch = c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while (batch := c.batches.retrieve(batch.id)).status not in FINISHED:
            assert time.monotonic() < deadline, f"the batch never finished: {batch}"
            time.sleep(0.1)
        assert batch.status == "completed", batch.errors
        assert batch.request_counts is not None and batch.request_counts.completed == 4
        output = rows(c, batch.output_file_id)
        assert sorted(row["custom_id"] for row in output) == [f"r{i}" for i in range(4)]
        assert all(row["response"]["status_code"] == 200 for row in output)
        request_ids = {row["response"]["request_id"] for row in output}
        deadline = time.monotonic() + 30
        while {r["request_id"] for r in ledger(gateway) if r.get("batch_id") == batch.id} < request_ids:
            assert time.monotonic() < deadline, "the lines' usage records never reached the ledger"
            time.sleep(0.1)
        billed = [r for r in ledger(gateway) if r.get("batch_id") == batch.id and r["status"] == "ok"]
        assert len(billed) == 4 and {r["key_id"] for r in billed} == {key_id}
        assert {r["tenant"] for r in billed} == {tenant_name}
        assert all(r["output_tokens"] > 0 for r in billed)

"""The gate's one room end to end: a real gateway whose only pool starts at zero replicas, with the
Batch API on and an SLO class that queues. Every wait is in the pool's waiting room, and each of the
checks has its say there: the cold start holds a plain request until a replica is ready; the SLO's
bound on a queued request's wait (its TTFT objective) ends a wait for that start early, with the
cold start's answer; batch lines go only on spare capacity, once the pool serves. Behaviour only:
every wait is "until this happens" with a generous ceiling.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from policies.policy import hash_key
from tests.e2e.test_autoscale import MESSAGES, MODEL, elastic_pool, ports
from tests.support.procs import TEST_KEY, Gateway, metric_total, policies_doc, start_gateway

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TIGHT_KEY = "sk-one-gate-tight-0000"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    policies = policies_doc(
        tenants={"t1": {}, "t2": {}, "tight": {"slo_class": "tight"}},
        slo_classes={"tight": {"ttft_ms": 1, "on_miss": "queue", "max_queue_ms": 60000}},
    )
    policies["keys"].append({"id": "kt", "tenant": "tight", "sha256": hash_key(TIGHT_KEY)})
    backends = {"devices": [0, 1], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports()}
    gw = start_gateway(
        tmp_path,
        pools=[elastic_pool(max_replicas=1, idle_s=600)],
        policies=policies,
        backends=backends,
        predictor={"enabled": False},  # the checks' verdicts, not the predictor's, are under test
        batch={"runner": {"tick_s": 0.05, "retry_min_s": 0.1}},
    )
    try:
        yield gw
    finally:
        gw.stop()


def ask(gw: Gateway, key: str = TEST_KEY) -> Any:
    client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
    return raw.http_response


def test_batch_slo_and_a_cold_pool_wait_in_one_room(gateway: Gateway) -> None:
    # 1. an SLO request that queues, at a pool with nothing serving: its TTFT objective bounds its wait
    #    for the start (waiting past it cannot help), and the answer is the cold start's
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TIGHT_KEY, max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
    assert refused.value.status_code == 503 and "cold_start" in refused.value.response.text
    assert refused.value.response.headers["retry-after"].isdigit()
    # 2. a plain request is held in the same room until the replica (started for the first) is ready
    response = ask(gateway)
    assert response.status_code == 200
    assert float(response.headers["x-tokenway-cold-start-ms"]) >= 0
    assert float(response.headers["x-tokenway-queued-ms"]) > 0  # the room's own account of the wait
    # both waited in the pool's room: its wait histogram saw them
    assert metric_total(gateway.url, "tokenway_queue_wait_seconds_count", pool="llama") >= 2
    # 3. a batch: its lines pass the batch check (spare capacity) and run on the warm pool
    openai_client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
        }
        for i in range(3)
    ]
    data = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
    upload = openai_client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    batch = openai_client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = openai_client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None
    rows = [json.loads(line) for line in openai_client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(row["custom_id"] for row in rows) == ["r0", "r1", "r2"]
    assert all(row["response"]["status_code"] == 200 for row in rows)

"""LoRA adapters over their life, end to end: simulated engines (`python -m sim --enable-lora`) behind
`tokenway serve`. The gateway learns from each engine's `/v1/models` which adapters it holds (one was
started with `--lora-modules`) and sends that adapter there without loading it anywhere; an adapter
marked `preload: true` is on every replica before any request asks for it; one that goes unused for
the pool's `lora_idle_unload_s` is unloaded; the metrics count requests and events per adapter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, http_get, metric_total, policies_doc, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
LORA_ARGS = ["--enable-lora", "--max-loras", "4"]
ROUTING = {
    "default": {
        "filters": [{"type": "lora-slots"}],
        "scorers": [{"type": "lora-affinity", "weight": 1.0}, {"type": "queue-depth", "weight": 0.1}],
        "picker": {"type": "max-score"},
    }
}


def _ask(base_url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": f"hello {uuid.uuid4().hex}"}], "max_tokens": 3}
    return httpx.post(
        f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {TEST_KEY}"}, timeout=60
    )


def _adapters(url: str) -> set[str]:
    data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def _listed_by_gateway(gateway_url: str) -> dict[str, list[str] | None]:
    status, body = http_get(gateway_url + "/admin/backends", timeout_s=10)
    assert status == 200, body
    return {e["url"]: e["loras"] for p in json.loads(body)["pools"] for e in p["endpoints"]}


@pytest.mark.timeout(120)
def test_discovery_preload_and_idle_unload(sim_factory: Any, gateway_factory: Any, tmp_path: Path) -> None:
    plain = sim_factory(count=2, served_model_name=MODEL, args=LORA_ARGS)
    holder = sim_factory(
        count=1, served_model_name=MODEL, args=[*LORA_ARGS, "--lora-modules", "sql-lora=s3://adapters/sql"]
    )
    urls = [*plain.urls, *holder.urls]
    models: dict[str, Any] = {
        MODEL: {},
        "sql-lora": {"kind": "adapter", "base": MODEL, "source": "s3://adapters/sql"},
        "chat-lora": {"kind": "adapter", "base": MODEL, "source": "s3://adapters/chat"},
        "pinned-lora": {"kind": "adapter", "base": MODEL, "source": "s3://adapters/pinned", "preload": True},
    }
    gateway = gateway_factory(
        pools=[static_pool("base", MODEL, urls, lora_idle_unload_s=1.5)],
        policies=policies_doc(models=models),
        routing=ROUTING,
        backends={"lora_discovery_interval_s": 0.2},
        ledger={"dir": str(tmp_path / "usage"), "commit_interval_ms": 20},
    )

    # preload: on every replica before any request
    wait_for(lambda: all("pinned-lora" in _adapters(u) for u in urls), what="pinned-lora preloaded everywhere")
    # discovery: the gateway sees the adapter the third engine was started with
    wait_for(
        lambda: "sql-lora" in (_listed_by_gateway(gateway.url).get(holder.urls[0]) or []),
        what="sql-lora discovered on the engine that holds it",
    )
    served_by = set()
    for _ in range(3):
        answer = _ask(gateway.base_url, "sql-lora")
        assert answer.status_code == 200, answer.text
        served_by.add(answer.headers["x-tokenway-endpoint"])
    assert served_by == {"base/both-s2"}  # the engine that holds it (the third static endpoint)
    assert not any("sql-lora" in _adapters(u) for u in plain.urls)  # loaded nowhere else
    assert metric_total(gateway.url, "tokenway_lora_adapter_events_total", lora_name="sql-lora", event="load") == 0
    assert metric_total(gateway.url, "tokenway_lora_requests_total", lora_name="sql-lora", status="ok") == 3

    # idle unload: chat-lora loaded on demand, gone once unused for the pool's 1.5 s; the preloaded one stays
    answer = _ask(gateway.base_url, "chat-lora")
    assert answer.status_code == 200, answer.text
    assert metric_total(gateway.url, "tokenway_lora_adapter_events_total", lora_name="chat-lora", event="load") == 1
    wait_for(lambda: not any("chat-lora" in _adapters(u) for u in urls), what="chat-lora unloaded when idle")
    assert all("pinned-lora" in _adapters(u) for u in urls)
    assert metric_total(gateway.url, "tokenway_lora_adapter_events_total", lora_name="chat-lora", event="unload") == 1
    assert (
        metric_total(gateway.url, "tokenway_lora_adapter_events_total", lora_name="pinned-lora", event="preload") == 3
    )

    again = _ask(gateway.base_url, "chat-lora")  # scaled to zero, loaded again on demand
    assert again.status_code == 200, again.text
    assert metric_total(gateway.url, "tokenway_lora_tokens_total", lora_name="chat-lora", token_type="output") > 0
    base = _ask(gateway.base_url, MODEL)  # the base model has no lora_name series
    assert base.status_code == 200, base.text
    assert metric_total(gateway.url, "tokenway_lora_requests_total", lora_name=MODEL) == 0

    # the ledger marks adapter requests with their base: usage per adapter
    expected = {"": 1, "sql-lora": 3, "chat-lora": 2}
    wait_for(lambda: _by_adapter(tmp_path / "usage") == expected, interval_s=0.5, what=f"usage by adapter {expected}")


def _by_adapter(ledger: Path) -> dict[str, int]:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "gateway.ledger.cli", "usage", "report", "--by", "adapter"),
            *("--format", "json", "--dir", str(ledger), "--progress", "off"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if out.returncode != 0:
        return {}
    return {row["adapter"]: row["requests"] for row in json.loads(out.stdout)["groups"]}

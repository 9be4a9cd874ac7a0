"""Cost and usage export end to end: Prometheus after traffic, OTLP traces from the real gateway, the
usage ledger surviving `kill -9` under load, and the report's totals."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from gateway.ledger.reader import iter_entries
from tests.support.otlp import Receiver
from tests.support.procs import REPO, TEST_KEY, Gateway, SimEngines, http_get, policies_doc, static_pool

pytestmark = pytest.mark.e2e

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about tokens."}]
MODELS = {
    "llama-3.1-8b": {
        "aliases": ["gpt-4o-mini"],
        "price": {"input_per_mtok": 2.0, "output_per_mtok": 8.0, "cached_input_per_mtok": 0.5},
    }
}


def samples(gateway: Gateway) -> dict[str, list[tuple[dict[str, str], float]]]:
    status, text = http_get(gateway.url + "/metrics")
    assert status == 200
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def total(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in found.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


def test_metrics_after_traffic(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    engines = sim_factory(count=2, served_model_name="llama-3.1-8b")
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(models=MODELS),
        ledger={"dir": str(tmp_path / "usage")},
    )
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    usage_sum = {"prompt": 0, "completion": 0}
    for i in range(3):
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=5 + i)
        assert reply.usage is not None
        usage_sum["prompt"] += reply.usage.prompt_tokens
        usage_sum["completion"] += reply.usage.completion_tokens
    streamed = list(client.chat.completions.create(model="llama-3.1-8b", messages=MESSAGES, max_tokens=4, stream=True))
    assert streamed
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    found = samples(gateway)
    for name in (
        "gen_ai_client_token_usage_sum",
        "gen_ai_server_time_to_first_token_seconds_count",
        "gen_ai_server_time_per_output_token_seconds_count",
        "gen_ai_server_request_duration_seconds_count",
        "tokenway_requests_total",
        "tokenway_cost_usd_total",
        "tokenway_gateway_overhead_seconds_count",
        "tokenway_routing_decisions_total",
        "tokenway_endpoint_state",
    ):
        assert name in found, f"{name} missing from /metrics"
    assert total(found, "tokenway_requests_total", tenant="t1", model="llama-3.1-8b") == 4
    assert total(found, "tokenway_requests_total", http_status="404", status="rejected") == 1
    # the streamed request's usage was learned even though the client did not ask for it
    input_tokens = total(found, "gen_ai_client_token_usage_sum", gen_ai_token_type="input")
    assert input_tokens == usage_sum["prompt"] + usage_sum["prompt"] // 3
    assert total(found, "gen_ai_server_time_to_first_token_seconds_count") == 1  # TTFT: the streamed request
    # cost from the price table: (input - cached) * 2 + cached * 0.5 + output * 8 per million
    cost = total(found, "tokenway_cost_usd_total")
    assert cost > 0
    for labels, _ in found["tokenway_requests_total"]:
        assert "request_id" not in labels and "user" not in labels  # bounded cardinality


async def test_traces_reach_an_otlp_receiver(
    receiver: Receiver, sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b")
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(models=MODELS),
        telemetry={"otlp": {"endpoint": receiver.url, "metrics_interval_s": 0.5}},
        ledger={"dir": str(tmp_path / "usage")},
    )
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="llama-3.1-8b",
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
            extra_headers={"traceparent": parent},
        )
        assert [chunk async for chunk in stream]  # consumed to the end: the trace completes
    gateway.stop()  # flushes the batch span processor
    names: set[str] = set()
    for _ in range(50):
        names = {span.name for span in receiver.spans()}
        if {"auth", "admission", "routing", "upstream", "accounting"} <= names:
            break
        import asyncio

        await asyncio.sleep(0.1)
    assert {"auth", "admission", "routing", "upstream", "accounting"} <= names
    spans = receiver.spans()
    assert {span.trace_id.hex() for span in spans} == {"4bf92f3577b34da6a3ce929d0e0e4736"}  # continued
    upstream = next(span for span in spans if span.name == "upstream")
    assert any(event.name == "first_token" for event in upstream.events)
    root = next(span for span in spans if span.name == "tokenway.request")
    keys = {attribute.key for attribute in root.attributes}
    assert {"gen_ai.request.model", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"} <= keys


def _load(base_url: str, done: list[tuple[str, float]], stop: threading.Event) -> None:
    """Sequential requests; each id is noted with the time its response arrived."""
    client = openai.OpenAI(base_url=base_url, api_key=TEST_KEY, max_retries=0, timeout=5)
    i = 0
    while not stop.is_set():
        request_id = f"load-{threading.get_ident()}-{i}"
        i += 1
        try:
            client.chat.completions.create(
                model="llama-3.1-8b", messages=MESSAGES, max_tokens=2, extra_headers={"x-request-id": request_id}
            )
        except openai.APIError:
            return
        done.append((request_id, time.monotonic()))


def test_ledger_survives_kill_9_under_load(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    engines = sim_factory(count=2, served_model_name="llama-3.1-8b", time_scale=50)
    usage_dir = tmp_path / "usage"
    interval_ms = 100
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(models=MODELS),
        ledger={"dir": str(usage_dir), "commit_interval_ms": interval_ms},
    )
    done: list[tuple[str, float]] = []
    stop = threading.Event()
    threads = [threading.Thread(target=_load, args=(gateway.base_url, done, stop)) for _ in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(done) < 150 and time.monotonic() < deadline:
        time.sleep(0.05)
    gateway.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    gateway.proc.wait(10)
    stop.set()
    for thread in threads:
        thread.join(10)
    committed = {rid for rid, at in done if at < killed_at - interval_ms / 1000}
    assert len(committed) > 50
    warnings: list[str] = []
    records = list(iter_entries(usage_dir, warn=warnings.append))
    ids = {r["request_id"] for r in records}
    missing = committed - ids
    assert not missing, f"{len(missing)} completed requests missing from the ledger"
    assert all("torn last line" in w for w in warnings), warnings  # no corrupt line, at most a torn tail


def test_report_totals_equal_the_records(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b")
    usage_dir = tmp_path / "usage"
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(models=MODELS),
        ledger={"dir": str(usage_dir)},
    )
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    for i in range(5):
        client.chat.completions.create(model="llama-3.1-8b", messages=MESSAGES, max_tokens=3 + i)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.base_url, api_key="bad", max_retries=0).chat.completions.create(
            model="llama-3.1-8b",
            messages=MESSAGES,
        )
    assert gateway.stop() == 0  # clean shutdown: everything flushed and fsynced
    records = list(iter_entries(usage_dir))
    assert len(records) == 6
    assert {r["status"] for r in records} == {"ok", "rejected"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.app.cli",
            "usage",
            "report",
            "--dir",
            str(usage_dir),
            "--since",
            "1h",
            "--by",
            "tenant,model",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    report: dict[str, Any] = json.loads(out.stdout)
    rows = report["groups"]
    assert sum(r["requests"] for r in rows) == report["total"]["requests"] == len(records)
    assert sum(r["cost_usd"] for r in rows) == pytest.approx(sum(r["cost_usd"] for r in records))
    assert report["total"]["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in records))
    for field in ("input_tokens", "output_tokens", "cached_input_tokens"):
        assert sum(r[field] for r in rows) == sum(r[field] for r in records)

# mypy: disable-error-code="union-attr,operator"
"""LoRA adapters on a real `vllm serve --enable-lora` launched by tokenway (issue 43, "Real engine").

A random-weight rank-8 adapter for the tiny model is written at test time (tiny_lora.py) and declared
in policies.yaml as docs/adapters.md says; the gateway loads it through the engine's runtime API on the
first request naming it, routes and bills it, and unloads it once idle. A second adapter is preloaded,
a third points at nothing and is refused by the engine. In order: preload; load on demand, answer,
ledger and metrics; the precise index against the engine's adapter-salted KV events; idle unload seen
in the engine's own /v1/models, then a reload on demand; an adapter unloaded behind the gateway's back
loaded again for the request that meets it; the engine's refusal as the gateway's 502.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from policies.policy import hash_key
from tests.real_vllm import tiny_lora
from tests.real_vllm.conftest import (
    MODEL,
    START_TIMEOUT_S,
    VLLM_PYTHON,
    admin_backends,
    backends_settings,
    launched_pool,
    ledger_entries,
)
from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, http_get, metric_total, start_gateway

# the first test starts the engine (its fixture): up to START_TIMEOUT_S on a busy machine, past pytest's 300 s
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(START_TIMEOUT_S + 300)]

ADAPTER = "tiny-lora"  # loaded on demand, unloaded when idle
PINNED = "pinned-lora"  # preload: true
BROKEN = "broken-lora"  # its source does not exist
IDLE_UNLOAD_S = 8.0  # long enough for a request pair on 2 busy cores, short enough to wait for
PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}
ADAPTER_PRICE = {"input_per_mtok": 3.0, "output_per_mtok": 5.0}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return tiny_lora.build(VLLM_PYTHON, model_dir, tmp_path_factory.mktemp("tiny-lora"))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, adapter_dir: Path) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("lora")
    lora_args = ["--enable-lora", "--max-lora-rank", str(tiny_lora.RANK), "--max-loras", "2"]
    pool = launched_pool(model_dir, kv_events={"enabled": True}, extra_args=lora_args)
    adapter = {"kind": "adapter", "base": MODEL, "source": str(adapter_dir), "price": ADAPTER_PRICE}
    policies = {
        "tenants": {"t1": {}},
        "keys": [{"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)}],
        "models": {
            MODEL: {"context_length": 2048, "price": PRICE},
            ADAPTER: {**adapter, "idle_unload_s": IDLE_UNLOAD_S},
            PINNED: {**adapter, "preload": True},
            BROKEN: {**adapter, "source": str(adapter_dir.parent / "no-such-adapter")},
        },
    }
    gw = start_gateway(
        workdir,
        pools=[pool],
        policies=policies,
        ready_timeout_s=START_TIMEOUT_S,
        routing={"prefix_index": {"mode": "precise", "advanced": {"speculative_ttl_s": 0}}},
        backends=backends_settings(health_interval_s=0.5, lora_discovery_interval_s=0.5),
        ledger={"commit_interval_ms": 20},
    )
    try:
        yield gw
    finally:
        if gw.proc.poll() is None:
            gw.stop()
        print(gw.log()[-3000:])


def engine_url(gw: Gateway) -> str:
    (pool,) = admin_backends(gw.url)["pools"]
    (endpoint,) = pool["endpoints"]
    return str(endpoint["url"])


def engine_adapters(gw: Gateway) -> dict[str, str | None]:
    """The adapters the engine itself lists in /v1/models, with their `parent` (the base model)."""
    status, text = http_get(engine_url(gw) + "/v1/models", timeout_s=10.0)
    assert status == 200, text[:300]
    return {m["id"]: m.get("parent") for m in json.loads(text)["data"] if m["id"] != MODEL}


def events(gw: Gateway, adapter: str, event: str) -> float:
    return metric_total(gw.url, "tokenway_lora_adapter_events_total", lora_name=adapter, event=event)


def chat(gw: Gateway, model: str, content: str) -> tuple[dict[str, str], Any]:
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=2,
        extra_headers={"x-tokenway-debug": "1"},
    )  # fmt: skip
    return dict(raw.headers), raw.parse()


def route_cached(headers: dict[str, str]) -> int:
    part = next(p for p in headers["x-tokenway-route"].split("; ") if p.startswith("cached="))
    return int(part.split("=", 1)[1])


def cached(completion: Any) -> int:
    details = completion.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_a_preloaded_adapter_is_on_the_engine_before_any_request(gateway: Gateway) -> None:
    wait_for(lambda: PINNED in engine_adapters(gateway), what="the preload", timeout_s=120)
    assert engine_adapters(gateway)[PINNED] == MODEL
    assert events(gateway, PINNED, "preload") == 1
    assert ADAPTER not in engine_adapters(gateway)  # loaded on demand only
    # discovery: the gateway reads the same listing (`loras` in /admin/backends)
    wait_for(lambda: PINNED in (listed_by_gateway(gateway) or []), what="discovery", timeout_s=60)


def listed_by_gateway(gw: Gateway) -> list[str] | None:
    (pool,) = admin_backends(gw.url)["pools"]
    loras: list[str] | None = pool["endpoints"][0]["loras"]
    return loras


def test_a_request_naming_the_adapter_loads_it_and_is_billed_to_it(gateway: Gateway) -> None:
    headers, answer = chat(gateway, ADAPTER, "hello adapter")
    assert answer.model == ADAPTER and answer.usage.completion_tokens == 2
    assert events(gateway, ADAPTER, "load") == 1
    request_id = headers["x-request-id"]
    entry = wait_for(lambda: next((e for e in ledger_entries(gateway.workdir) if e["request_id"] == request_id), None),
                     what="the ledger line", timeout_s=60)  # fmt: skip
    assert (entry["model"], entry["base_model"]) == (ADAPTER, MODEL)
    expected = answer.usage.prompt_tokens * 3.0 + answer.usage.completion_tokens * 5.0  # the adapter's price
    assert entry["cost_usd"] == pytest.approx(expected / 1e6)
    assert metric_total(gateway.url, "tokenway_lora_requests_total", lora_name=ADAPTER, status="ok") == 1


def test_the_precise_index_matches_the_adapters_blocks_and_not_the_base_models(gateway: Gateway) -> None:
    """vLLM publishes the adapter's blocks with `lora_name` and the adapter first in `extra_keys` (block 0:
    [adapter, the tenant's cache_salt]); the index keys them by the adapter, as it hashes the request."""
    prefix = words(uuid.uuid4().hex[:6], 120)  # ~500 tokens: 3 full blocks of 128

    def blocks() -> int:
        (pool,) = admin_backends(gateway.url)["pools"]
        return int(pool["endpoints"][0]["precise_index"]["blocks"])

    before = blocks()
    headers, first = chat(gateway, ADAPTER, prefix + " first question")
    assert (route_cached(headers), cached(first)) == (0, 0)
    wait_for(lambda: blocks() > before, what="BlockStored events for the adapter", timeout_s=60)
    headers, second = chat(gateway, ADAPTER, prefix + " second question")
    assert route_cached(headers) == cached(second) >= 256  # the index agrees with the engine
    headers, base = chat(gateway, MODEL, prefix + " second question")
    assert (route_cached(headers), cached(base)) == (0, 0)  # the base model shares no block with it


def test_an_idle_adapter_is_unloaded_from_the_engine_and_loaded_again_on_demand(gateway: Gateway) -> None:
    wait_for(lambda: ADAPTER not in engine_adapters(gateway), what="the idle unload", timeout_s=IDLE_UNLOAD_S + 60)
    assert events(gateway, ADAPTER, "unload") >= 1
    assert PINNED in engine_adapters(gateway)  # preloaded: never unloaded for idleness
    loads = events(gateway, ADAPTER, "load")
    _, again = chat(gateway, ADAPTER, "back again")
    assert again.model == ADAPTER
    assert events(gateway, ADAPTER, "load") == loads + 1
    assert ADAPTER in engine_adapters(gateway)


def test_an_adapter_unloaded_behind_the_gateways_back_is_loaded_again_for_the_next_request(gateway: Gateway) -> None:
    """The pool's only replica lost the adapter (an operator's unload, as after a restart): whether the
    listing shows it first or the engine's 404 does, the request is answered, not refused."""
    if ADAPTER not in engine_adapters(gateway):
        chat(gateway, ADAPTER, "load it")
    lost = events(gateway, ADAPTER, "lost")
    gone = httpx.post(engine_url(gateway) + "/v1/unload_lora_adapter", json={"lora_name": ADAPTER}, timeout=30)
    assert gone.status_code == 200, gone.text
    _, answer = chat(gateway, ADAPTER, "still there?")
    assert answer.model == ADAPTER
    assert events(gateway, ADAPTER, "lost") >= lost + 1
    assert ADAPTER in engine_adapters(gateway)


def test_an_adapter_the_engine_cannot_load_is_a_502_naming_it(gateway: Gateway) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        chat(gateway, BROKEN, "hello")
    assert raised.value.status_code == 502
    assert BROKEN in raised.value.message
    assert events(gateway, BROKEN, "load_failed") == 1
    assert BROKEN not in engine_adapters(gateway)

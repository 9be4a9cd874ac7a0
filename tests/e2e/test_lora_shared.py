"""LoRA adapter idleness shared by two gateways on one Redis (`state: redis`), end to end: a simulated
engine (`python -m sim --enable-lora`) behind two `tokenway serve` processes. Gateway B loads an adapter
and then sees no request for it, while gateway A keeps sending requests for it to the same engine for
several idle periods: B leaves it loaded (the fleet's last use is A's), A never has to load it again,
and once nobody asks for it the adapter is unloaded after the idle time.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, metric_total, policies_doc, static_pool

# B judges idleness from A's uses, which reach it through Redis about once a second: the idle time is
# ten times that lag, so a loaded parallel run cannot pass it (the behaviour, not the clock, is tested)
pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.timeout(240)]

MODEL = "llama-3.1-8b"
IDLE_S = 10.0


def _ask(base_url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex}"}], "max_tokens": 2}
    answer = httpx.post(
        f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {TEST_KEY}"}, timeout=60
    )
    assert answer.status_code == 200, answer.text


def _on_engine(url: str) -> set[str]:
    data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def _events(gateway: Any, event: str) -> float:
    return metric_total(gateway.url, "tokenway_lora_adapter_events_total", lora_name="chat-lora", event=event)


def _replica_loads(gateway: Any) -> tuple[int, str]:
    answer = httpx.get(f"{gateway.url}/admin/adapters", timeout=10)
    assert answer.status_code == 200, answer.text
    (replica,) = answer.json()["pools"][0]["replicas"]
    return int(replica["loads"]), str(replica["counted_by"])


def test_traffic_through_one_gateway_keeps_the_other_from_unloading(
    sim_factory: Any, gateway_factory: Any, redis_url: str, redis_prefix: str
) -> None:
    engine = sim_factory(count=1, served_model_name=MODEL, args=["--enable-lora", "--max-loras", "4"])
    url = engine.urls[0]
    models: dict[str, Any] = {MODEL: {}, "chat-lora": {"kind": "adapter", "base": MODEL, "source": "s3://chat"}}
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": redis_prefix}

    def gateway() -> Any:
        return gateway_factory(
            pools=[static_pool("base", MODEL, [url], lora_idle_unload_s=IDLE_S)],
            policies=policies_doc(models=models),
            backends={"lora_discovery_interval_s": 0.2},
            state=state,
        )

    a, b = gateway(), gateway()
    _ask(b.base_url, "chat-lora")  # B loads it
    assert _events(b, "load") == 1 and "chat-lora" in _on_engine(url)

    # A alone asks for it, for two of B's idle periods: it stays on the engine all along
    until = time.monotonic() + 2 * IDLE_S
    while time.monotonic() < until:
        _ask(a.base_url, "chat-lora")
        assert "chat-lora" in _on_engine(url), "unloaded while gateway A was using it"
        time.sleep(0.3)
    assert _events(b, "unload") == 0 and _events(a, "unload") == 0
    assert _events(a, "load") == 0  # A served what the engine listed: no reload was ever needed
    # A's console counts B's load on the engine they share (the adapter view is every gateway's)
    wait_for(lambda: _replica_loads(a) == (1, "fleet"), what="B's load in A's adapter view")

    # nobody asks: unloaded once the fleet's idle time has passed
    wait_for(lambda: "chat-lora" not in _on_engine(url), timeout_s=60, what="chat-lora unloaded when idle fleet-wide")

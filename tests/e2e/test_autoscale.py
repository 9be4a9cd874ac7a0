"""Elastic pools end to end: a real gateway launching simulated engines on simulated devices.

A pool at zero replicas holds its first request while a replica starts (the answer says how long,
and the learnt start-up time), refuses what is past `max_held` with 503 and retry-after, scales back
to zero once idle, and with `sleep` wakes from sleep instead of starting cold. Behaviour only: every
wait is "until this happens" with a generous ceiling.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, free_port, http_get, metric_total, policies_doc, start_gateway

pytestmark = pytest.mark.e2e


def ports() -> dict[str, int]:
    """Port bases of our own (the defaults are shared by every gateway on this host)."""
    return {name: free_port() for name in ("port_base", "kv_events_port_base", "kv_events_replay_port_base",
                                            "kv_transfer_port_base")}  # fmt: skip


MODEL = "llama-3.1-8b"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def elastic_pool(**autoscale: Any) -> dict[str, Any]:
    sleep = autoscale.pop("sleep", None)
    policy = {"min_replicas": 0, "max_replicas": 2, "idle_s": 6, "interval_s": 0.5, "max_hold_s": 60,
              "scale_down_cooldown_s": 0, "stabilization_s": 0, "startup_s": 5, **autoscale}  # fmt: skip
    if sleep:
        policy["sleep"] = {"level": 1}
    return {
        "name": "llama",
        "model": MODEL,
        "engine": "sim",
        "preset": "llama-3.1-8b@h100",
        "replicas": 0,
        "devices": "auto",
        "ready_timeout_s": 60,
        "drain_timeout_s": 10,
        "extra_args": ["--simulate-startup", "--time-scale", "10"],  # 13 s of loading, 1.3 s of wall time
        "autoscale": policy,
    }


@pytest.fixture
def gateway(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Gateway]:
    pool = elastic_pool(**getattr(request, "param", {}))
    backends = {"devices": [0, 1], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports()}
    gw = start_gateway(tmp_path, pools=[pool], backends=backends)
    try:
        yield gw
    finally:
        gw.stop()


def pools(gw: Gateway) -> dict[str, Any]:
    status, body = http_get(gw.url + "/admin/pools")
    assert status == 200, body
    found: dict[str, Any] = json.loads(body)["pools"][0]
    return found


def chat(gw: Gateway) -> Any:
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
    return raw.http_response


def test_a_pool_at_zero_holds_its_first_request_through_a_cold_start(gateway: Gateway) -> None:
    status, _ = http_get(gateway.url + "/readyz")
    assert status == 200  # at zero replicas it can still serve: it starts one on demand
    assert pools(gateway)["roles"]["both"]["current"] == 0
    response = chat(gateway)
    assert response.status_code == 200
    held_ms = float(response.headers["x-tokenway-cold-start-ms"])
    assert held_ms > 0
    response = chat(gateway)  # warm now: no hold (the pool idles out only after idle_s)
    assert "x-tokenway-cold-start-ms" not in response.headers
    status_now = pools(gateway)
    actions = [e["action"] for e in status_now["events"]]
    assert actions[:2] == ["start", "ready"]
    assert status_now["measured"]["starts_s"]  # the launch was timed: the learnt start-up time
    assert metric_total(gateway.url, "tokenway_cold_start_wait_seconds_count") == 1
    replicas = metric_total(gateway.url, "tokenway_pool_replicas", state="ready")
    assert replicas == 1
    assert metric_total(gateway.url, "tokenway_pool_desired_replicas") >= 1
    # the operator's view: current vs desired, the reason, the learnt start-up, the decisions
    shown = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "pools", "status", "--url", gateway.url],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "autoscale (a pass every" in shown and "desired" in shown
    assert "start-up" in shown and "-> {'both': 1}" in shown
    # idle for idle_s: back to zero, stopped, devices freed
    wait_for(
        lambda: pools(gateway)["roles"]["both"]["replicas"]["stopped"] == 2, what="the scale-down to zero", timeout_s=90
    )
    assert [e["action"] for e in pools(gateway)["events"]][-2:] == ["drain", "stop"]


@pytest.mark.parametrize("gateway", [{"max_held": 1}], indirect=True)
def test_past_max_held_the_answer_is_503_with_retry_after(gateway: Gateway) -> None:
    first: list[Any] = []
    holder = threading.Thread(target=lambda: first.append(chat(gateway)))
    holder.start()
    wait_for(lambda: pools(gateway)["held"] == 1, what="the first request to be held", timeout_s=90)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"].isdigit()
    assert "cold_start" in refused.value.response.text
    holder.join(120)
    assert first and first[0].status_code == 200


@pytest.mark.parametrize("gateway", [{"sleep": True}], indirect=True)
def test_an_idle_pool_sleeps_and_wakes_instead_of_starting_cold(gateway: Gateway) -> None:
    assert chat(gateway).status_code == 200  # a cold start
    wait_for(
        lambda: pools(gateway)["roles"]["both"]["replicas"]["sleeping"] == 1,
        what=lambda: f"the replica to sleep {pools(gateway)['events']}",
        timeout_s=90,
    )
    assert http_get(gateway.url + "/readyz")[0] == 200
    response = chat(gateway)
    assert response.status_code == 200
    assert "x-tokenway-cold-start-ms" in response.headers
    actions = [e["action"] for e in pools(gateway)["events"]]
    assert actions[-2:] == ["wake", "awake"] or actions[-3:-1] == ["wake", "awake"]
    assert pools(gateway)["measured"]["wakes_s"]


def stream_story(gw: Gateway, out: list[str], max_tokens: int = 1500) -> None:
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=120)
    try:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "A long story, please."}],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        finish = None
        for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        out.append(finish or "cut")
    except Exception as exc:
        out.append(repr(exc))


@pytest.mark.parametrize(
    "drain_timeout_s", [pytest.param(60, id="drain-completes"), pytest.param(0.3, id="drain-times-out")]
)
def test_scale_down_drains_and_never_cuts_a_stream(tmp_path: Path, drain_timeout_s: float) -> None:
    pool = elastic_pool(min_replicas=1, idle_s=600)
    pool.update(replicas=2, drain_timeout_s=drain_timeout_s, extra_args=["--time-scale", "1"])
    backends = {"devices": [0, 1], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports()}
    # no scale-down in the first seconds (the cooldown counts from the launch): the streams begin first
    # (on a loaded host the replicas can take most of that to be ready; the streams outlast it)
    pool["autoscale"]["scale_down_cooldown_s"] = 15
    # streams alternate between the two replicas, so the one drained has two in flight
    routing = {"pools": {"llama": {"router": "round-robin"}}}
    gw = start_gateway(tmp_path, pools=[pool], backends=backends, routing=routing)
    try:
        wait_for(lambda: pools(gw)["roles"]["both"]["replicas"]["ready"] == 2, what="both replicas", timeout_s=90)
        finishes: list[str] = []
        threads = [threading.Thread(target=stream_story, args=(gw, finishes, 3000)) for _ in range(4)]
        for thread in threads:
            thread.start()
        wait_for(
            lambda: any(e["action"] == "drain" for e in pools(gw)["events"]), what="a scale-down to begin", timeout_s=90
        )
        for thread in threads:
            thread.join(120)
        assert finishes == ["length"] * 4  # every stream ended as asked, none aborted
        wait_for(
            lambda: pools(gw)["roles"]["both"]["replicas"]["stopped"] == 1,
            what="the drained replica to stop",
            timeout_s=90,
        )
        status = pools(gw)
        drain = next(e for e in status["events"] if e["action"] == "drain")
        assert drain["detail"].startswith("2 in flight")
        assert status["drain_timeouts"] == (1 if drain_timeout_s < 1 else 0)  # then its streams moved
    finally:
        gw.stop()


def test_models_sharing_a_device_take_turns(tmp_path: Path) -> None:
    """Two models on one device, at most one awake: a request for the sleeping one wakes it and puts
    the other to sleep once its requests are done; switching back is a wake, not a cold start."""
    share = {"max_awake": 1, "min_awake_s": 0}
    # idle_s beyond the test: the turns come from the shared device, not from idling (on a loaded host
    # an idle_s shorter than the start-up puts llama to sleep before the first look)
    turns = {"sleep": True, "max_replicas": 1, "idle_s": 600}
    first, second = elastic_pool(**turns), elastic_pool(**turns)
    first.update(name="llama", replicas=1, devices=[0], share=share)
    second.update(name="qwen", model="qwen2.5-7b", preset="qwen2.5-7b@h100", devices=[0], share=share)
    policies = policies_doc(models={MODEL: {}, "qwen2.5-7b": {}}, tenants={"t1": {}, "t2": {}})
    backends = {"devices": [0], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports()}
    gw = start_gateway(tmp_path, pools=[first, second], policies=policies, backends=backends)
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=120)

    def ask(model: str) -> Any:
        raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
        return raw.http_response

    def awake() -> dict[str, int]:
        _, body = http_get(gw.url + "/admin/pools")
        return {p["name"]: p["roles"]["both"]["current"] for p in json.loads(body)["pools"]}

    try:
        wait_for(lambda: awake() == {"llama": 1, "qwen": 0}, what="llama awake", timeout_s=90)
        assert ask(MODEL).status_code == 200
        response = ask("qwen2.5-7b")  # llama sleeps, qwen starts (its first time: cold)
        assert response.status_code == 200 and "x-tokenway-cold-start-ms" in response.headers
        assert awake() == {"llama": 0, "qwen": 1}
        response = ask(MODEL)  # qwen sleeps, llama wakes
        assert response.status_code == 200
        switch_ms = float(response.headers["x-tokenway-cold-start-ms"])
        assert switch_ms > 0
        _, body = http_get(gw.url + "/admin/pools")
        llama = next(p for p in json.loads(body)["pools"] if p["name"] == "llama")
        assert [e["action"] for e in llama["events"]][-4:] == ["drain", "sleep", "wake", "awake"]
        assert awake() == {"llama": 1, "qwen": 0}
    finally:
        gw.stop()

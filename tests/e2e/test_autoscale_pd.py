"""Convertible decoders in a prefill/decode pool under a prefill burst: decode replicas with headroom
prefill while the prefill replica is backed up, and when the imbalance lasts the planner converts a
decode replica into a prefill one within the same device budget."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, free_port, http_get, start_gateway

pytestmark = pytest.mark.e2e


def ports() -> dict[str, int]:
    """Port bases of our own (the defaults are shared by every gateway on this host)."""
    return {name: free_port() for name in ("port_base", "kv_events_port_base", "kv_events_replay_port_base",
                                            "kv_transfer_port_base")}  # fmt: skip


MODEL = "llama-3.1-8b"


def pd_pool() -> dict[str, Any]:
    bounds = {"prefill": {"min_replicas": 1, "max_replicas": 2}, "decode": {"min_replicas": 1, "max_replicas": 2}}
    return {
        "name": "pd",
        "model": MODEL,
        "engine": "sim",
        "preset": "llama-3.1-8b@h100",
        "roles": {"prefill": 1, "decode": 2},
        "kv_transfer": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        "devices": "auto",
        "extra_args": ["--time-scale", "0.1"],  # a slow engine: a few prompts back the prefill replica up
        "ready_timeout_s": 60,
        "autoscale": {
            "roles": bounds,
            "interval_s": 0.5,
            "stabilization_s": 2,
            "scale_down_cooldown_s": 4,
            "ttft_slo_ms": 5000,
            "tpot_slo_ms": 500,
            "idle_s": 600,
        },
    }


def pools(gw: Gateway) -> dict[str, Any]:
    """/admin/pools, with a timeout for a 2-core host that also runs the burst's gateway and engines."""
    status, body = http_get(gw.url + "/admin/pools", timeout_s=30.0)
    assert status == 200, body
    result: dict[str, Any] = json.loads(body)
    return result


def roles(gw: Gateway) -> dict[str, int]:
    pool = pools(gw)["pools"][0]
    return {role: info["current"] for role, info in pool["roles"].items()}


def ready(gw: Gateway) -> dict[str, int]:
    pool = pools(gw)["pools"][0]
    return {role: info["replicas"]["ready"] for role, info in pool["roles"].items()}


def test_prefill_burst_converts_a_decoder(tmp_path: Path) -> None:
    backends = {
        "devices": [0, 1, 2], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports(),
        "ready_poll_interval_s": 0.1,
    }  # fmt: skip
    routing = {"pools": {"pd": {"pd": {"min_uncached_tokens": 64, "convertible": {"backlog_tokens": 1500}}}}}
    gw = start_gateway(
        tmp_path, pools=[pd_pool()], backends=backends, routing=routing, predictor={"prior": {"time_scale": 0.1}}
    )
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=120)
    reasons: list[str] = []
    stop = threading.Event()

    def burst() -> None:
        while not stop.is_set():
            text = " ".join(f"{uuid.uuid4().hex[:6]}-{i}" for i in range(600))  # ~3,000 uncached tokens
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": text}],
                max_tokens=2,
                extra_headers={"x-tokenway-debug": "1"},
            )
            route = raw.headers.get("x-tokenway-route", "")
            reasons.extend(p.split("=", 1)[1] for p in route.split("; ") if p.startswith("pd="))

    try:
        # the burst starts once every replica serves: on a loaded host the prefill replica can still be
        # starting when it begins, every request then routes `no-prefill-endpoint`, and the pool may
        # convert before the prefill replica was ever backed up (the phase this test is about)
        wait_for(
            lambda: ready(gw) == {"prefill": 1, "decode": 2}, timeout_s=120, interval_s=0.2, what="all replicas ready"
        )
        workers = [threading.Thread(target=burst, daemon=True) for _ in range(8)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 120
        while roles(gw) != {"prefill": 2, "decode": 1}:
            assert time.monotonic() < deadline, f"no conversion: {pools(gw)}"
            time.sleep(0.2)
        stop.set()
        for worker in workers:
            worker.join(120)
        assert "prefill-backlog" in reasons  # decoders prefilled while the prefill replica was backed up
        assert "disaggregated" in reasons
        events = [(e["role"], e["action"]) for e in pools(gw)["pools"][0]["events"]]
        stopped = events.index(("decode", "stop"))  # a decoder gave its device back...
        started = events.index(("prefill", "start"), stopped)  # ...and a prefill replica took it
        assert events[started + 1] == ("prefill", "ready")
    finally:
        stop.set()
        gw.stop()

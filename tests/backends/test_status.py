"""Fleet status: the JSON of GET /admin/backends and the table of `tokenway pools status`."""

from __future__ import annotations

from backends.fleet import Fleet
from backends.scrape import fleet_status, format_status
from backends.types import EndpointState, EndpointStats
from tests.backends.builders import pool


def make_fleet() -> Fleet:
    fleet = Fleet.from_configs([
        pool(name="llm", model="llama", engine="vllm", endpoints=[{"url": "http://10.0.0.1:8000"},
                                                                   {"url": "http://10.0.0.2:8000"}]),
        pool(name="remote", model="llama", engine="openai", endpoints=[{"url": "https://api.example.com/v1"}]),
    ])  # fmt: skip
    ready, dead = fleet.pools["llm"].endpoints
    ready.state = EndpointState.READY
    ready.stats = EndpointStats(running=3, waiting=1, kv_usage_ratio=0.42, block_size=16, num_gpu_blocks=100,
                                scraped_at_s=99.5)  # fmt: skip
    ready.inflight.begin(prefill_tokens=30)
    dead.state = EndpointState.DEAD
    dead.restarts = 4
    dead.state_reason = "crash loop: exited 5 times within 300s (last: exit code 1); not restarting"
    dead.log_tail = ("Traceback (most recent call last):", "RuntimeError: CUDA error")
    dead.log_path = "var/log/engines/llm.both-1.log"
    return fleet


def test_fleet_status_json() -> None:
    status = fleet_status(make_fleet(), now_s=100.0)
    llm, remote = status["pools"]
    assert (llm["name"], llm["ready"], llm["total"], llm["states"]) == ("llm", 1, 2, {"ready": 1, "dead": 1})
    ready, dead = llm["endpoints"]
    assert ready["state"] == "ready" and ready["running"] == 3 and ready["kv_usage_ratio"] == 0.42
    assert ready["stats_age_s"] == 0.5 and ready["stats_stale"] is False
    assert ready["inflight_requests"] == 1 and ready["inflight_prefill_tokens"] == 30
    assert "log_tail" not in ready
    assert dead["restarts"] == 4 and dead["reason"].startswith("crash loop")
    assert dead["log_tail"] == ["Traceback (most recent call last):", "RuntimeError: CUDA error"]
    assert remote["endpoints"][0]["stats_stale"] is False  # a remote API has no metrics to go stale


def test_format_status_table() -> None:
    text = format_status(fleet_status(make_fleet(), now_s=100.0))
    assert "pool llm (model llama, engine vllm): 1/2 ready" in text
    row = next(line for line in text.splitlines() if "llm/both-s0" in line).split()
    assert row[:8] == ["llm/both-s0", "ready", "3", "1", "42%", "1", "0", "0.5s"]
    assert "reason: crash loop" in text
    assert "| RuntimeError: CUDA error" in text


def test_stale_ready_endpoints_are_marked() -> None:
    text = format_status(fleet_status(make_fleet(), now_s=200.0, stats_max_age_s=2.0))
    assert "ready*" in text and "routing treats the endpoint as saturated" in text

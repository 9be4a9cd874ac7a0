"""A frozen engine (issue 39, class 11): one of two simulated replicas stopped with SIGSTOP.

Real processes: two simulated engines (one process each, so that stopping one leaves the other
running) behind `tokenway serve`. The pool routes round-robin so that requests keep reaching the
stopped replica until it leaves routing. Deadlines are small in the test's configuration so that it is
quick; the assertions are about behaviour (which replica served, what the client got, what was
recorded), never about how long anything took.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.ledger.reader import iter_entries
from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, SimEngines, http_get, metric_total, policies_doc, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
ADMIN = "frozen-admin"
A, B = "llama/both-s0", "llama/both-s1"


def _backends(gateway: Gateway) -> dict[str, dict[str, Any]]:
    status, text = http_get(gateway.url + "/admin/backends", {"Authorization": f"Bearer {ADMIN}"}, timeout_s=10)
    assert status == 200, text
    return {e["id"]: e for p in json.loads(text)["pools"] for e in p["endpoints"]}


def _leases(gateway: Gateway) -> int:
    status, text = http_get(gateway.url + "/admin/status", {"Authorization": f"Bearer {ADMIN}"}, timeout_s=10)
    assert status == 200, text
    return sum(r.get("active", 0) for r in json.loads(text)["limits"] if r.get("kind") == "concurrency")


class _Stream(threading.Thread):
    """One streamed chat request read to its end; `started` once its headers (and first token) came."""

    def __init__(self, gateway: Gateway, max_tokens: int, request_id: str) -> None:
        super().__init__(daemon=True)
        self.url = gateway.base_url + "/chat/completions"
        self.body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"tell me a long story {request_id}"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        self.request_id = request_id
        self.started = threading.Event()
        self.status = 0
        self.endpoint = ""
        self.text = ""
        self.error: BaseException | None = None

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {TEST_KEY}", "x-request-id": self.request_id}
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=headers, timeout=120) as response:
                self.status = response.status_code
                self.endpoint = response.headers.get("x-tokenway-endpoint", "")
                self.started.set()
                self.text = "".join(response.iter_text())
        except BaseException as exc:  # seen by the test's assertions
            self.error = exc
        finally:
            self.started.set()


def _unary(gateway: Gateway, request_id: str) -> httpx.Response:
    return httpx.post(
        gateway.base_url + "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": request_id}], "max_tokens": 8},
        headers={"Authorization": f"Bearer {TEST_KEY}", "x-request-id": request_id},
        timeout=120,
    )


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Pids the test stopped: always continued at the end, whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_stopped_replica_leaves_routing_and_its_requests_finish_on_the_other(
    sim_factory: Callable[..., SimEngines],
    gateway_factory: Callable[..., Gateway],
    stopped: list[int],
    tmp_path: Path,
) -> None:
    engine_a = sim_factory(count=1, served_model_name=MODEL, time_scale=1)
    engine_b = sim_factory(count=1, served_model_name=MODEL, time_scale=1)
    usage_dir = tmp_path / "usage"
    gateway = gateway_factory(
        pools=[static_pool("llama", MODEL, [*engine_a.urls, *engine_b.urls])],
        policies=policies_doc(limits=[{"id": "conc", "scope": "key", "max_concurrent": 64}]),
        server={
            "admin_token": ADMIN,
            "first_token_deadline": {"default_s": 1.0, "min_s": 0.5, "max_s": 1.0, "misses_to_stall": 2},
            "stall_after_s": 1.5,
        },
        backends={"ejection": {"cooldown_s": 1.0, "max_cooldown_s": 2.0}},
        routing={"pools": {"llama": {"router": "round-robin"}}},
        ledger={"dir": str(usage_dir), "commit_interval_ms": 20},
    )

    # two long streams, one on each replica (round-robin), both relaying tokens
    long_streams = [_Stream(gateway, 500, f"long-{i}-{uuid.uuid4().hex[:8]}") for i in range(2)]
    for stream in long_streams:
        stream.start()
    for stream in long_streams:
        assert stream.started.wait(60), "a stream never started"
    assert {s.endpoint for s in long_streams} == {A, B}, [s.endpoint for s in long_streams]

    stopped.append(engine_b.proc.pid)
    os.kill(engine_b.proc.pid, signal.SIGSTOP)

    # requests sent now: round-robin keeps choosing the stopped replica until it leaves routing
    streams = [_Stream(gateway, 16, f"new-{i}-{uuid.uuid4().hex[:8]}") for i in range(4)]
    for stream in streams:
        stream.start()
    unary_ids = [f"unary-{i}-{uuid.uuid4().hex[:8]}" for i in range(4)]
    unary = [_unary(gateway, request_id) for request_id in unary_ids]
    for stream in [*streams, *long_streams]:
        stream.join(120)
        assert not stream.is_alive(), f"{stream.request_id} still hangs"
        assert stream.error is None, (stream.request_id, stream.error)

    # every new request completed, on the replica that runs
    for stream in streams:
        assert (stream.status, stream.endpoint) == (200, A), (stream.request_id, stream.endpoint, stream.text[-300:])
        assert stream.text.rstrip().endswith("data: [DONE]"), stream.text[-300:]
    for response in unary:
        assert response.status_code == 200, response.text
        assert response.headers["x-tokenway-endpoint"] == A
        assert response.json()["choices"][0]["message"]["content"]
    # the stream that was on the stopped replica did not hang: it continued on the other one
    on_b = next(s for s in long_streams if s.endpoint == B)
    assert on_b.status == 200
    assert on_b.text.rstrip().endswith("data: [DONE]"), on_b.text[-300:]

    # the stopped replica left routing, found by the first-token deadlines it missed or its silence
    assert _backends(gateway)[B]["state"] != "ready"
    assert "stalled" in gateway.log()
    assert metric_total(gateway.url, "tokenway_upstream_errors_total", endpoint=B) >= 1
    assert metric_total(gateway.url, "tokenway_upstream_errors_total", endpoint=A) == 0

    # exactly one record per request, served; nothing left reserved
    ids = [s.request_id for s in [*streams, *long_streams]] + unary_ids

    def recorded() -> bool:
        found = [r["request_id"] for r in iter_entries(usage_dir)] if usage_dir.exists() else []
        return all(found.count(i) >= 1 for i in ids)

    wait_for(recorded, interval_s=0.1, what="every request in the usage ledger")
    records = [r for r in iter_entries(usage_dir) if r["request_id"] in ids]
    assert sorted(r["request_id"] for r in records) == sorted(ids)
    assert all(r["http_status"] == 200 for r in records), records
    by_id = {r["request_id"]: r for r in records}
    for request_id, response in zip(unary_ids, unary, strict=True):  # billed once, for what it got
        assert by_id[request_id]["output_tokens"] == response.json()["usage"]["completion_tokens"]
    moved = [r for r in records if r["upstream_attempts"] > 1]
    assert moved and all(r["endpoint"] == A for r in moved)  # some were moved off the stopped one
    wait_for(lambda: _leases(gateway) == 0, interval_s=0.1, what="every lease returned")

    # continued, it passes its health checks and routes again
    os.kill(engine_b.proc.pid, signal.SIGCONT)
    wait_for(
        lambda: _backends(gateway)[B]["state"] == "ready",
        interval_s=0.1,
        what=lambda: f"the continued engine to be ready: {_backends(gateway)[B]}",
    )
    served = {
        httpx.post(
            gateway.base_url + "/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": f"again {i}"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {TEST_KEY}"},
            timeout=60,
        ).headers["x-tokenway-endpoint"]
        for i in range(4)
    }
    assert served == {A, B}

"""Scheduled capacity end to end: a floor set through the admin API starts replicas a start-up time
before its window opens, and once it ends the idle pool goes back to zero. Real gateway, simulated
engines on simulated devices; every wait is "until this happens" with a generous ceiling.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_autoscale import elastic_pool, pools, ports
from tests.support.polling import wait_for
from tests.support.procs import Gateway, free_port, http_get, start_gateway

pytestmark = pytest.mark.e2e


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    elastic = elastic_pool()
    static = {"name": "static", "model": "other-model", "engine": "vllm",
              "endpoints": [{"url": f"http://127.0.0.1:{free_port()}"}]}  # fmt: skip
    backends = {"devices": [0, 1], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports()}
    gw = start_gateway(tmp_path, pools=[elastic, static], backends=backends, server={"ready_when": "any_pool"})
    try:
        yield gw
    finally:
        gw.stop()


def send(gw: Gateway, method: str, path: str, body: object = None) -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(gw.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_floors_are_refused_in_the_admin_error_shape(gateway: Gateway) -> None:
    path = "/admin/pools/llama/floor"
    for body, param in [
        (b"{not json", None),
        ([1], None),
        ({"min_replicas": 2}, "for_s"),
        ({"min_replicas": -1, "for_s": 5}, "min_replicas"),
        ({"min_replicas": True, "for_s": 5}, "min_replicas"),
        ({"min_replicas": 10**18, "for_s": 5}, "min_replicas"),  # bounded before it is stored
        ({"min_replicas": 1, "for_s": 0}, "for_s"),
        ({"min_replicas": 1, "for_s": 5, "start_in_s": -1}, "start_in_s"),
        ({"min_replicas": 1, "for_s": "5"}, "for_s"),
        ({"min_replicas": 1, "for_s": 5, "role": "decode"}, "role"),  # not a prefill/decode pool
        ({"min_replicas": 1, "for_s": 5, "extra": 1}, "extra"),
    ]:
        status, answer = send(gateway, "PUT", path, body)
        assert status == 400, (body, answer)
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["param"] == param, (body, answer)
    status, answer = send(gateway, "PUT", "/admin/pools/nope/floor", {"min_replicas": 1, "for_s": 5})
    assert status == 404 and answer["error"]["code"] == "not_found"
    status, answer = send(gateway, "PUT", "/admin/pools/static/floor", {"min_replicas": 1, "for_s": 5})
    assert status == 409 and "not autoscaled" in answer["error"]["message"]
    for _ in range(16):
        assert send(gateway, "PUT", path, {"min_replicas": 0, "start_in_s": 600, "for_s": 5})[0] == 200
    status, answer = send(gateway, "PUT", path, {"min_replicas": 0, "start_in_s": 600, "for_s": 5})
    assert status == 409 and "at most 16" in answer["error"]["message"]
    status, answer = send(gateway, "DELETE", path)
    assert status == 200 and answer["cleared"] == 16 and answer["floors"] == []


def test_a_floor_starts_replicas_before_its_window_and_the_pool_returns_to_zero_after(gateway: Gateway) -> None:
    assert pools(gateway)["roles"]["both"]["current"] == 0
    # the lead is the start-up estimate (5 s) plus a pass (0.5 s): nothing starts in the first ~14 s
    status, answer = send(gateway, "PUT", "/admin/pools/llama/floor", {"min_replicas": 2, "start_in_s": 20, "for_s": 4})
    assert status == 200, answer
    assert answer["floor"]["min_replicas"] == 2 and not answer["floor"]["active"]
    status, listed = send(gateway, "GET", "/admin/pools/llama/floor")
    assert status == 200 and [f["min_replicas"] for f in listed["floors"]] == [2]
    seen: dict[str, Any] = {}

    def started() -> bool:
        seen.update(pools(gateway))
        return bool(seen["roles"]["both"]["current"] == 2)

    wait_for(started, what="the floor's replicas to start", timeout_s=90)
    floor = seen["floors"][0]
    assert not floor["active"] and floor["starts_in_s"] > 0  # started ahead of the window
    assert any("scheduled floor 2" in d["reason"] for d in seen["decisions"])
    shown = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "pools", "status", "--url", gateway.url],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "floor 2 (admin)" in shown
    wait_for(
        lambda: pools(gateway)["roles"]["both"]["replicas"]["ready"] == 2, what="both replicas ready", timeout_s=90
    )
    # no request came: once the floor ends the idle pool goes back to zero, drained and stopped
    wait_for(
        lambda: pools(gateway)["roles"]["both"]["replicas"]["stopped"] == 2,
        what="the scale-down after the floor",
        timeout_s=90,
    )
    assert pools(gateway)["floors"] == []
    assert http_get(gateway.url + "/readyz")[0] == 200

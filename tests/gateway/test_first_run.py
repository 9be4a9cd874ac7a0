"""What a new operator meets first: a taken port, the banner's curl, `tokenway check`, `pools plan`
without secrets, output piped to `head`, readiness rules, and a reload that changes nothing."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from gateway.http.routes import ready_by_rule
from policies.holder import PolicyHolder
from tests.support.procs import REPO, free_port, start_gateway

EXAMPLE = REPO / "config" / "examples" / "remote-fallback.yaml"


def tokenway(*args: str, cwd: Path = REPO, env_drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    return subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.e2e  # runs the `tokenway` command
def test_a_taken_port_says_so_and_starts_nothing(tmp_path: Path) -> None:
    shutil.copy(REPO / "config" / "policies.yaml", tmp_path / "policies.yaml")
    config = {"policies": "policies.yaml", "pools": [{"name": "p", "model": "m", "engine": "sim", "replicas": 1}]}
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        run = tokenway("serve", "--config", str(tmp_path / "gateway.yaml"), "--port", str(port), cwd=tmp_path)
    assert run.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in run.stderr
    assert f"make run PORT={port + 1}" in run.stderr
    assert "Traceback" not in run.stderr and "launching" not in run.stderr + run.stdout


@pytest.mark.e2e  # runs the `tokenway` command
def test_the_banner_curl_works_as_pasted(tmp_path: Path) -> None:
    shutil.copy(REPO / "config" / "policies.yaml", tmp_path / "policies.yaml")
    pools = [{"name": "p", "model": "llama-3.1-8b", "engine": "sim", "preset": "llama-3.1-8b@h100", "replicas": 1}]
    gateway = start_gateway(tmp_path, pools=pools, policies=yaml.safe_load((tmp_path / "policies.yaml").read_text()))
    try:
        line = next(line for line in gateway.log().splitlines() if "try: curl" in line)
        command = line.split("try: ", 1)[1]
        assert '-H "Authorization: Bearer tw-demo-key-0000"' in command  # double quotes, the real demo key
        if shutil.which("curl"):
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0 and '"chat.completion"' in done.stdout, done.stdout + done.stderr
        # the banner's links (the landing page, the console, metrics, the API document) each answer
        links = dict(re.findall(r"^  (about|console|metrics|API): +(http://\S+)$", gateway.log(), re.MULTILINE))
        assert set(links) == {"about", "console", "metrics", "API"}, gateway.log()
        for name, url in links.items():
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert reply.status == 200, name
                if name == "about":
                    page = reply.read().decode()
                    assert all(f'href="{path}"' in page for path in ("/ui", "/metrics", "/openapi.json")), page
    finally:
        gateway.stop()


@pytest.mark.e2e  # runs the `tokenway` command
def test_pools_plan_takes_several_files_and_shows_unset_secrets_as_placeholders() -> None:
    second = REPO / "config" / "examples" / "vllm-8b-4gpu.yaml"
    run = tokenway("pools", "plan", str(EXAMPLE), "--config", str(second), env_drop=("OPENAI_API_KEY",))
    assert run.returncode == 0, run.stderr
    assert "environment variable OPENAI_API_KEY is not set; shown as ${OPENAI_API_KEY}" in run.stderr
    assert f"# === {EXAMPLE}" in run.stdout and f"# === {second}" in run.stdout
    assert "pool openai" in run.stdout and "pool llama-8b" in run.stdout


@pytest.mark.e2e  # runs the `tokenway` command
def test_check_passes_the_default_config_and_names_a_broken_one(tmp_path: Path) -> None:
    ok = tokenway("check", "--config", str(REPO / "config" / "gateway.yaml"), "--no-probe")
    assert ok.returncode == 0 and "ok" in ok.stdout, ok.stdout + ok.stderr
    policies = yaml.safe_load((REPO / "config" / "policies.yaml").read_text())
    (tmp_path / "policies.yaml").write_text(yaml.safe_dump(policies))
    config = {
        "policies": "policies.yaml",
        "pools": [
            {
                "name": "llama",
                "model": "llama-3.1-8b",
                "engine": "vllm",
                "endpoints": [{"url": f"http://127.0.0.1:{free_port()}"}],
            },
            {
                "name": "hosted",
                "model": "gpt-4o-mini",
                "engine": "openai",
                "endpoints": [{"url": "http://127.0.0.1:9"}],
            },
        ],
    }
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
    bad = tokenway("check", "--config", str(tmp_path / "gateway.yaml"))
    assert bad.returncode == 1
    assert "alias 'gpt-4o-mini' shadows pool 'hosted'" in bad.stderr
    assert "unreachable" in bad.stdout  # the probe: nothing listens on the static endpoints
    secretless = tokenway(
        "check", "--config", str(EXAMPLE), "--no-probe", "--allow-unset", env_drop=("OPENAI_API_KEY",)
    )
    assert secretless.returncode == 0, secretless.stdout + secretless.stderr


@pytest.mark.e2e  # runs the `tokenway` command
def test_output_piped_into_a_closed_reader_ends_quietly() -> None:
    files = [str(REPO / "config" / "examples" / "vllm-8b-4gpu.yaml")] * 60  # far more than a pipe buffer
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.app.cli", "pools", "plan", *files],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    stderr = proc.stderr.read().decode()
    assert proc.wait(60) == 141
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr


@pytest.mark.parametrize(
    ("rule", "pools", "default", "ready"),
    [
        ("all_pools", {"a": True, "b": False}, None, False),
        ("all_pools", {"a": True, "b": True}, None, True),
        ("default_pool", {"a": True, "b": False}, None, True),  # the first pool
        ("default_pool", {"a": True, "b": False}, "b", False),
        ("any_pool", {"a": False, "b": True}, None, True),
        ("any_pool", {"a": False, "b": False}, None, False),
    ],
)
def test_readiness_rules(rule: str, pools: dict[str, bool], default: str | None, ready: bool) -> None:
    assert ready_by_rule(pools, rule, default) is ready


@pytest.mark.slow
def test_a_reload_that_changes_nothing_keeps_the_generation(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text("tenants: {t: {}}\n")
    holder = PolicyHolder.from_file(path)
    path.write_text("# a comment only\ntenants: {t: {}}\n")
    same = holder.reload()
    assert same.ok and not same.changed and same.generation == 1
    path.write_text("tenants: {t: {priority: high}}\n")
    changed = holder.reload()
    assert changed.ok and changed.changed and changed.generation == 2

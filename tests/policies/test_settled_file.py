"""Policy files are loaded whole: read once per reload, and only once a writer has finished (an
in-place rewrite is caught half-way otherwise, and a prefix of a YAML file often parses)."""

from __future__ import annotations

import builtins
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.app.policy_reload import _identity
from policies.holder import PolicyHolder, UnsettledFile, read_settled
from policies.policy import hash_key


def doc(limits: list[dict[str, Any]]) -> str:
    return yaml.safe_dump(
        {
            "tenants": {"t": {}},
            "keys": [{"id": "k", "tenant": "t", "sha256": hash_key("sk")}],
            "models": {"big": {}},
            "limits": limits,
        },
        sort_keys=False,
    )


FULL = doc([{"id": "a", "scope": "key", "rpm": 10}, {"id": "b", "scope": "tenant", "tpm": 1000}])
PREFIX = FULL[: FULL.index("- id: b")]  # valid YAML on its own: the second limit is simply missing


def test_the_prefix_of_a_policy_file_parses_which_is_why_this_matters() -> None:
    assert len(yaml.safe_load(PREFIX)["limits"]) == 1


@pytest.mark.slow
def test_a_file_caught_half_written_is_read_once_the_writer_is_done(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(PREFIX)
    os.utime(path)  # just written: not settled yet
    calls: list[float] = []

    def writer_finishes_while_we_wait(seconds: float) -> None:
        if not calls:
            with open(path, "a") as fh:  # the in-place writer's second write
                fh.write(FULL[len(PREFIX) :])
        calls.append(seconds)
        time.sleep(seconds)

    assert read_settled(path, settle_s=3.0, sleep=writer_finishes_while_we_wait) == FULL
    assert calls


@pytest.mark.slow
def test_a_file_that_keeps_changing_is_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(FULL)

    def rewrite(seconds: float) -> None:
        path.write_text(FULL + f"# {time.monotonic()}\n")
        time.sleep(seconds)

    with pytest.raises(UnsettledFile):
        read_settled(path, settle_s=0.5, max_wait_s=1.0, sleep=rewrite)


@pytest.mark.slow
def test_an_mtime_in_the_future_settles_by_watching(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(FULL)
    future = time.time() + 3600
    os.utime(path, (future, future))
    assert read_settled(path, settle_s=0.2) == FULL


@pytest.mark.slow
def test_a_reload_reads_the_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(FULL)
    holder = PolicyHolder.from_file(path)
    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file) == str(path):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: pytest.fail(f"second read of {self}"))
    path.write_text(doc([{"id": "a", "scope": "key", "rpm": 20}]))
    result = holder.reload()
    assert result.ok and result.changed
    assert len(opened) == 1
    assert [rule.rpm for rule in holder.current.config.limits] == [20]


@pytest.mark.slow
def test_a_configmap_style_symlink_swap_is_seen_and_loaded(tmp_path: Path) -> None:
    """Kubernetes mounts `policies.yaml -> ..data/policies.yaml` and swaps `..data` atomically."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "policies.yaml").write_text(FULL)
    (tmp_path / "..data").symlink_to("v1")
    path = tmp_path / "policies.yaml"
    path.symlink_to("..data/policies.yaml")
    holder = PolicyHolder.from_file(path)
    seen = _identity(path)
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "policies.yaml").write_text(doc([{"id": "a", "scope": "key", "rpm": 30}]))
    (tmp_path / "..data_tmp").symlink_to("v2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert _identity(path) != seen  # the watcher notices the swap
    assert holder.reload().ok
    assert [rule.rpm for rule in holder.current.config.limits] == [30]

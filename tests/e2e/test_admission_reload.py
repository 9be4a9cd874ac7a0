"""Hot reload through the app's cleanup_ctx: a saved file, SIGHUP and an explicit reload all swap the
policy without restarting; an invalid file keeps the running policy and records the error."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from gateway.app.policy_reload import PolicyWatcher, policy_reload_ctx
from policies.holder import PolicyHolder
from policies.policy import hash_key
from tests.support.polling import wait_for_async

WATCHER = web.AppKey("policy_watcher", PolicyWatcher)


def write(path: Path, rpm: int) -> None:
    doc: dict[str, Any] = {
        "tenants": {"t": {}},
        "keys": [{"id": "k", "tenant": "t", "sha256": hash_key("sk")}],
        "limits": [{"scope": "key", "rpm": rpm}],
    }
    path.write_text(yaml.safe_dump(doc))


def rpm_of(holder: PolicyHolder) -> int | None:
    return holder.current.config.limits[0].rpm


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[tuple[Path, PolicyHolder, web.Application]]:
    path = tmp_path / "policies.yaml"
    write(path, 10)
    holder = PolicyHolder.from_file(path)
    app = web.Application()
    app.cleanup_ctx.append(policy_reload_ctx(holder, poll_interval_s=0.02, watcher_key=WATCHER))
    runner = web.AppRunner(app)
    await runner.setup()
    yield path, holder, app
    await runner.cleanup()


async def test_a_saved_file_applies_without_restart(watched: tuple[Path, PolicyHolder, web.Application]) -> None:
    path, holder, _ = watched
    tmp = path.with_suffix(".tmp")
    write(tmp, 20)
    tmp.replace(path)  # how editors and config managers save: a rename
    await wait_for_async(lambda: rpm_of(holder) == 20)
    assert holder.generation == 2


async def test_an_invalid_file_keeps_the_old_policy(watched: tuple[Path, PolicyHolder, web.Application]) -> None:
    path, holder, _ = watched
    path.write_text("limits:\n  - scope: key\n    rpm: many\n")
    await wait_for_async(lambda: bool(holder.last_error))
    assert rpm_of(holder) == 10 and holder.generation == 1
    assert holder.status()["last_error"] == [f"{path}:3: limits[0].rpm: expected an integer, got 'many'"]
    write(path, 30)
    await wait_for_async(lambda: rpm_of(holder) == 30)
    assert holder.status()["last_error"] is None


async def test_sighup_and_explicit_reloads(watched: tuple[Path, PolicyHolder, web.Application]) -> None:
    path, holder, app = watched
    watcher = app[WATCHER]
    watcher.poll_interval_s = 3600.0  # only the signal may notice the next change
    await asyncio.sleep(0.05)
    write(path, 40)
    os.kill(os.getpid(), signal.SIGHUP)
    await wait_for_async(lambda: rpm_of(holder) == 40)
    write(path, 50)
    result = await watcher.reload("admin")
    assert result.ok and rpm_of(holder) == 50

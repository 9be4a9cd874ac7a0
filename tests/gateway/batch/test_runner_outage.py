"""The batch runner while its Redis is down: one traceback per outage (then counted, not logged each
tick), ticks that back off instead of spinning at `tick_s`, one line when Redis is back, and the
batches run on after it — against a real redis-server started late on the store's port."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gateway.batch.capacity import BatchCapacity
from gateway.batch.config import BatchSettings
from gateway.batch.redis_store import RedisBatchStore
from gateway.batch.runner import BatchRunner, Outage
from tests.gateway.batch.test_runner import SETTINGS, Walk, create, fleet, ok, policy_holder, upload
from tests.support.procs import free_port, redis_argv, spawn, stop_process


def test_backoff_doubles_from_the_tick_up_to_its_ceiling() -> None:
    outage = Outage("x")
    assert outage.backoff_s(0.25, 30.0) == 0.25
    waits = []
    for _ in range(12):
        outage.failed(ConnectionError("down"))
        waits.append(outage.backoff_s(0.25, 30.0))
    assert waits[:3] == [0.5, 1.0, 2.0] and waits == sorted(waits) and waits[-1] == 30.0
    outage.ok()
    assert outage.backoff_s(0.25, 30.0) == 0.25


@pytest.mark.redis
async def test_a_redis_outage_is_logged_once_and_the_runner_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    settings = BatchSettings.model_validate({"runner": {**SETTINGS.runner.model_dump(), "retry_max_s": 0.2}})
    store = RedisBatchStore.from_url(f"redis://127.0.0.1:{port}/0", "outage", tmp_path / "scratch")
    built = fleet()
    capacity = BatchCapacity(
        built, settings.spare.limits(settings.runner.max_lines_per_endpoint), waiting=lambda pool: 0
    )
    runner = BatchRunner(store, settings, policy_holder(), capacity, Walk(built, capacity.load, ok))
    caplog.set_level(logging.INFO, logger="tokenway.batch")
    server: subprocess.Popen[bytes] | None = None
    await runner.start()
    try:
        deadline = time.monotonic() + 30
        while runner.outage.failures < 8:  # nothing listens on the port: every tick fails
            assert time.monotonic() < deadline, "the runner stopped ticking"
            await asyncio.sleep(0.02)
        tracebacks = [r for r in caplog.records if r.exc_info is not None]
        assert len(tracebacks) == 1 and "batch runner tick failed" in tracebacks[0].getMessage()
        assert runner.outage.backoff_s(settings.runner.tick_s, 0.2) == 0.2  # backing off, not spinning

        server = spawn(redis_argv(binary, port, tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while runner.outage.failures:
            assert time.monotonic() < deadline, "the runner never recovered"
            await asyncio.sleep(0.02)
        assert any("works again after" in r.getMessage() for r in caplog.records)
        assert len([r for r in caplog.records if r.exc_info is not None]) == 1

        batch = await create(store, await upload(store, tmp_path, 5))  # type: ignore[arg-type]
        runner.wake()
        while (meta := await store.get_batch(batch.id)) is None or meta.status != "completed":
            assert time.monotonic() < deadline, f"the batch never completed: {meta}"
            await asyncio.sleep(0.02)
    finally:
        await runner.stop()
        await store.close()
        if server is not None:
            stop_process(server)

"""A launched simulated pool's shared KV store (`kv_store:` on an `engine: sim` pool), kept running
by the supervisor beside the pool's replicas (backends/plan.py plans it: `PlannedStore`).

It is spawned like an engine (its own process group, tied to the gateway's life, logged to
`<log_dir>/<pool>.kv-store.log`), started again after a backoff when it exits (1, 2, 4, ... up to
`STORE_BACKOFF_MAX_S`), and stopped after the replicas. While it is away the replicas serve without it
and join the new one, which starts empty (sim/kv_store.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from backends.plan import PlannedStore
from backends.process import EngineProcess, describe_exit, error_lines

log = logging.getLogger(__name__)

STORE_BACKOFF_MAX_S = 30.0


@dataclass(slots=True)
class StoreRunner:
    """One pool's store process and the task that keeps it running."""

    planned: PlannedStore
    stopping: Callable[[], bool]
    process: EngineProcess | None = None
    task: asyncio.Task[None] | None = None
    exits: int = 0

    @classmethod
    def start(cls, planned: PlannedStore, *, stopping: Callable[[], bool]) -> StoreRunner:
        """Start keeping `planned` running (on the running loop) until `stopping()` or `stop`."""
        runner = cls(planned, stopping)
        runner.task = asyncio.create_task(runner._run(), name=f"kv store {planned.pool}")
        return runner

    async def _run(self) -> None:
        store = self.planned
        while not self.stopping():
            try:
                self.process = await EngineProcess.spawn(store.spec, header=f"kv store of pool {store.pool}")
            except OSError as exc:
                log.error("kv store of pool %s could not start: %s", store.pool, exc)
            else:
                log.info("kv store of pool %s at %s (pid %s)", store.pool, store.url, self.process.pid)
                code = await self.process.wait()
                if self.stopping():
                    return
                log.error(
                    "kv store of pool %s exited (%s): its replicas serve without it until it is back; %s",
                    store.pool,
                    describe_exit(code),
                    " | ".join(error_lines(store.spec.log_path)),
                )
            self.exits += 1
            await asyncio.sleep(min(2.0 ** min(self.exits, 5), STORE_BACKOFF_MAX_S))

    async def stop(self, grace_s: float) -> None:
        """Stop keeping it running, then SIGTERM it (SIGKILL after `grace_s`)."""
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.process is not None and self.process.alive:
            await self.process.terminate(grace_s)

    def kill_now(self) -> None:
        """Synchronous, at interpreter exit."""
        if self.process is not None:
            self.process.kill_now()

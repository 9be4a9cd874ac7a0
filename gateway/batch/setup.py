"""The Files and Batch APIs in the app: the batch check among the gate's checks, the store, the runner.

`batch_gate` builds what the walk needs (the gate's batch check and the capacity view it shares with the
runner) while the app factory builds the walk; `batch_ctx` then opens the store — on disk under
`batch.dir` with `state: memory`, in Redis with `state: redis` — and runs the runner for the app's
life. On the way out the runner stops first (its lines in flight are claimed again later), then
the store closes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from backends.fleet import Fleet
from gateway.apis.routes import RESPONSE_STORE
from gateway.app import keys as appkeys
from gateway.batch.capacity import BatchCapacity
from gateway.batch.disk import DiskBatchStore
from gateway.batch.gate import BatchGate
from gateway.batch.metrics import BatchMetrics
from gateway.batch.redis_store import RedisBatchStore
from gateway.batch.runner import BatchRunner
from gateway.batch.service import BATCH, BatchService
from gateway.batch.store import BatchStore
from gateway.batch.walk import walk_runner
from gateway.flow.slo import PredictsLatency

BATCH_CAPACITY: web.AppKey[BatchCapacity | None] = web.AppKey("batch_capacity")


def batch_gate(
    app: web.Application, fleet: Fleet, waiting: Callable[[str], int], predictor: PredictsLatency | None
) -> BatchGate | None:
    """The gate's batch check (None when the Batch API is off); `waiting(pool)` counts the interactive
    requests waiting for the pool in the gate's room."""
    settings = app[appkeys.SETTINGS].batch
    if not settings.enabled:
        app[BATCH_CAPACITY] = None
        return None
    limits = settings.spare.limits(settings.runner.max_lines_per_endpoint)
    capacity = BatchCapacity(fleet, limits, waiting=waiting)
    app[BATCH_CAPACITY] = capacity
    return BatchGate(capacity, app[appkeys.POLICIES], predictor, settings.runner.retry_min_s)


async def batch_ctx(app: web.Application) -> AsyncIterator[None]:
    gateway = app[appkeys.SETTINGS]
    settings = gateway.batch
    capacity = app.get(BATCH_CAPACITY)
    if not settings.enabled or capacity is None:
        app[BATCH] = None
        yield
        return
    state = gateway.state
    scratch: Path | None = None
    store: BatchStore
    if state.backend == "redis" and state.redis_url:
        scratch = Path(tempfile.mkdtemp(prefix="tokenway-batch-"))
        store = RedisBatchStore.from_url(state.redis_url, state.key_prefix, scratch)
    else:
        store = DiskBatchStore(Path(settings.dir), fsync=settings.fsync)
    metrics = BatchMetrics()
    runner = BatchRunner(
        store,
        settings,
        app[appkeys.POLICIES],
        capacity,
        walk_runner(app[appkeys.DIRECTOR], app[RESPONSE_STORE]),
        observer=metrics,
        usage_committed=ledger.flush if (ledger := app[appkeys.LEDGER]) is not None else None,
    )
    metrics.register(app[appkeys.METRICS].registry, lambda: runner.lines_in_flight, lambda: runner.statuses)
    app[BATCH] = BatchService(store, settings, app[appkeys.POLICIES], runner.wake)
    await runner.start()
    try:
        yield
    finally:
        await runner.stop()
        await store.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

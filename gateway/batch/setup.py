"""The Files and Batch APIs in the app: the batch check among the gate's checks, the store, the runner.

`batch_gate` builds what the walk needs (the gate's batch check and the capacity view it shares with the
runner) while the app factory builds the walk; `batch_ctx` then opens the store — on disk under
`batch.dir` with `state: memory`, in Redis with `state: redis` — and runs the runner for the app's
life. On the way out the runner stops first (its lines in flight are claimed again later), then
the store closes.

## What the routes share (`BatchService`)

What the Files and Batch routes share: the store, the settings, the policy, the runner's wake-up,
and the per-tenant bounds on batch objects.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from backends.fleet import Fleet
from gateway.apis.routes import RESPONSE_STORE
from gateway.app import keys as appkeys
from gateway.batch.capacity import BatchCapacity, BatchGate
from gateway.batch.config import BatchSettings
from gateway.batch.disk import DiskBatchStore
from gateway.batch.lines import walk_runner
from gateway.batch.metrics import BatchMetrics
from gateway.batch.objects import BatchMeta, Counts, batch_object
from gateway.batch.redis_store import RedisBatchStore
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.errors import GatewayError
from gateway.flow.checks import PredictsLatency
from policies.holder import PolicyHolder


class TooManyBatches(GatewayError):
    status = 429
    type = "invalid_request_error"
    code = "batch_quota_exceeded"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers=[("x-should-retry", "false")])


def _no_wake() -> None:
    return None


@dataclass(slots=True)
class BatchService:
    store: BatchStore
    settings: BatchSettings
    policies: PolicyHolder
    wake: Callable[[], None] = _no_wake

    async def render(self, meta: BatchMeta) -> dict[str, Any]:
        frozen = meta.final_counts
        counts = Counts(*frozen) if frozen is not None else await self.store.counts(meta.id)
        return batch_object(meta, counts)

    async def make_room(self, tenant: str) -> None:
        """Room for one more batch of `tenant`: under its active bound (else 429), and under its kept
        bound once the oldest finished batches beyond it are dropped."""
        bounds = self.settings.tenant
        batches = await self.store.tenant_batches(tenant)  # oldest first
        active = sum(1 for b in batches if not b.finished)
        if active >= bounds.max_active_batches:
            raise TooManyBatches(
                f"tenant '{tenant}' has {active} unfinished batches (limit {bounds.max_active_batches}); "
                "wait for one to finish or cancel one"
            )
        excess = len(batches) + 1 - bounds.max_batches
        for meta in batches:
            if excess <= 0:
                break
            if meta.finished:
                await self.store.delete_batch(meta.id)
                excess -= 1

    async def batch_reading(self, file_id: str) -> str | None:
        """The id of an unfinished batch whose input is `file_id`, if any."""
        for batch_id in await self.store.active_batches():
            meta = await self.store.get_batch(batch_id)
            if meta is not None and meta.input_file_id == file_id:
                return meta.id
        return None


BATCH: web.AppKey[BatchService | None] = web.AppKey("batch_service")


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

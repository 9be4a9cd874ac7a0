"""What the Files and Batch routes share: the store, the settings, the policy, the runner's wake-up,
and the per-tenant bounds on batch objects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.batch.config import BatchSettings
from gateway.batch.objects import BatchMeta, Counts, batch_object
from gateway.batch.store import BatchStore
from gateway.errors import GatewayError
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

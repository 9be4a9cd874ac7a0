"""Where files, batches and per-line progress live: the contract both stores keep.

- `DiskBatchStore` (`state: memory`, the embedded default): one gateway process, everything under
  `batch.dir`; a lock file keeps a second process off the same directory.
- `RedisBatchStore` (`state: redis`): every replica sees every file and batch, and lines are claimed
  in Redis so two replicas never run the same line at once.

The line protocol is the same in both. `claim` hands out lines nobody holds (never-run ones, ones
whose deferral is over, and — Redis — ones whose claimant went silent past its lease). `record`
makes results durable *before* it returns, and records a line at most once: a second result for
the same line (a line run twice after a lost claim) is refused, so the output has one answer per
line. A line counts as done only once recorded; a line claimed when the process died, whose result
was never recorded, is claimed again — so after a crash a line may have *run* twice (its first run
lost with the process), but it is never *recorded* twice and never lost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from pathlib import Path
from typing import Protocol

from gateway.batch.objects import BatchMeta, Counts, FileMeta
from gateway.batch.results import LineResult


class QuotaExceeded(Exception):
    """The tenant's storage bound (files or bytes) would be exceeded."""


class BatchStore(Protocol):
    def scratch(self) -> Path:
        """A folder for files being written (uploads, outputs) before `add_file` takes them."""
        ...

    async def lock(self, name: str, ttl_s: float) -> bool:
        """Take a named lock for `ttl_s` (one finalizer per batch across replicas); False if held."""
        ...

    async def unlock(self, name: str) -> None: ...

    # --- files --------------------------------------------------------------------------------------
    async def add_file(self, meta: FileMeta, content: Path, spans: Sequence[int], *, limits: tuple[int, int]) -> None:
        """Keep the file at `content` (moved or copied in; the caller removes what is left) with its
        request spans ((offset, length) pairs). `limits` (max files, max bytes) of the tenant:
        QuotaExceeded when it would go over (output files pass (0, 0): never refused)."""
        ...

    async def get_file(self, file_id: str) -> FileMeta | None: ...

    async def list_files(self, owner: str) -> list[FileMeta]:
        """The owner's files, newest first."""
        ...

    async def delete_file(self, file_id: str) -> bool: ...

    async def expired_files(self, now_s: float) -> list[str]:
        """Ids of files whose `expires_at` has passed."""
        ...

    async def read_lines(self, file_id: str, indices: Sequence[int]) -> list[bytes]:
        """The request lines at these indices (0-based, blank lines not counted)."""
        ...

    def content(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, in chunks."""
        ...

    # --- batches ------------------------------------------------------------------------------------
    async def add_batch(self, meta: BatchMeta) -> None: ...

    async def get_batch(self, batch_id: str) -> BatchMeta | None: ...

    async def list_batches(self, owner: str) -> list[BatchMeta]:
        """The owner's batches, newest first."""
        ...

    async def tenant_batches(self, tenant: str) -> list[BatchMeta]: ...

    async def update_batch(self, batch_id: str, when: Collection[str], **changes: object) -> BatchMeta | None:
        """Apply `changes` if the batch's status is one of `when` (compare-and-set); the new meta, or
        None when the status was not (another replica or request moved it first)."""
        ...

    async def delete_batch(self, batch_id: str) -> None: ...

    async def expired_batches(self, finished_before_s: float) -> list[str]:
        """Ids of batches that finished before this time."""
        ...

    async def active_batches(self) -> list[str]:
        """Ids of batches that are not finished (the runner's work list)."""
        ...

    # --- lines --------------------------------------------------------------------------------------
    async def counts(self, batch_id: str) -> Counts: ...

    async def claim(self, batch_id: str, n: int, lease_s: float) -> list[int]: ...

    async def renew(self, batch_id: str, indices: Collection[int], lease_s: float) -> None: ...

    async def defer(self, batch_id: str, indices: Collection[int], delay_s: float) -> None:
        """Give the lines back, to be claimed again after `delay_s` (0: at once)."""
        ...

    async def record(self, batch_id: str, results: Sequence[LineResult]) -> list[bool]:
        """Make the results durable; True for each one recorded now, False for a line already recorded."""
        ...

    async def held(self, batch_id: str) -> int:
        """Lines claimed and not recorded (by any replica)."""
        ...

    async def unrecorded(self, batch_id: str) -> list[int]:
        """Indices of the lines without a result, in order."""
        ...

    def results(self, batch_id: str) -> AsyncIterator[LineResult]:
        """Every recorded result, in line order."""
        ...

    async def drop_progress(self, batch_id: str) -> None:
        """Forget the per-line records (the batch is finished and its files written)."""
        ...

    async def close(self) -> None: ...

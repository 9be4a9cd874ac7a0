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

## One line's outcome (`LineResult`)

One line's outcome, as the output and error files carry it and as the store records it.

Output and error files use OpenAI's per-line object: `{"id": "batch_req_…", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}` for a request that got an HTTP answer (2xx in
the output file, 4xx/5xx in the error file), and `{"id", "custom_id", "response": null, "error":
{"code", "message"}}` for one that never got one (expired, cancelled, the batch's key revoked).

The store records each result once, write-ahead, as `<header JSON>\t<line JSON>\n`: the header
holds the line's index, whether it succeeded and its usage, so progress and the batch's usage are
rebuilt from the records alone, and the output files are the records' second halves in line order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from gateway.batch.objects import BatchMeta, Counts, FileMeta, new_line_result_id

Usage3 = tuple[int, int, int]  # input, cached input, output tokens


@dataclass(frozen=True, slots=True)
class LineResult:
    index: int
    ok: bool
    usage: Usage3
    line: bytes  # the output / error file line (JSON, no newline)

    def record(self) -> bytes:
        header = orjson.dumps({"i": self.index, "ok": self.ok, "u": list(self.usage)})
        return header + b"\t" + self.line + b"\n"

    @classmethod
    def read(cls, raw: bytes) -> LineResult | None:
        """`parse`, or None for a record that is not one (a shared store holds what anything wrote)."""
        try:
            return cls.parse(raw)
        except (ValueError, KeyError, TypeError, IndexError):  # (orjson's decode error is a ValueError)
            return None

    @classmethod
    def parse(cls, raw: bytes) -> LineResult:
        header, _, line = raw.rstrip(b"\n").partition(b"\t")
        data = orjson.loads(header)
        u = data["u"]
        if not line:
            raise ValueError("a result record without its line")
        return cls(int(data["i"]), bool(data["ok"]), (int(u[0]), int(u[1]), int(u[2])), line)


def usage_of(body: Any) -> Usage3:
    """(input, cached, output) tokens of an answer body of any batch endpoint."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return (0, 0, 0)
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    output = usage.get("completion_tokens", usage.get("output_tokens"))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return (_int(prompt), _int(cached), _int(output))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def answered(index: int, custom_id: str, status: int, request_id: str, body: bytes) -> LineResult:
    """A line that got an HTTP answer: 2xx goes to the output file, anything else to the error file."""
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = {"error": {"message": body[:2000].decode("utf-8", "replace"), "type": "server_error"}}
    ok = 200 <= status < 300
    line = {
        "id": new_line_result_id(),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": parsed},
        "error": None,
    }
    return LineResult(index, ok, usage_of(parsed) if ok else (0, 0, 0), orjson.dumps(line))


def unanswered(index: int, custom_id: str, code: str, message: str) -> LineResult:
    """A line that never got an HTTP answer (error file)."""
    line = {
        "id": new_line_result_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return LineResult(index, False, (0, 0, 0), orjson.dumps(line))


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

    async def content_bytes(self, file_id: str) -> int:
        """How many bytes of the file's content the store holds (checked against its record before the
        content is sent: a download announces its length first)."""
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

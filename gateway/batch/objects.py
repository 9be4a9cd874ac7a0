"""The Files and Batch APIs' objects: what the store keeps and how each is shown to clients.

`FileMeta` and `BatchMeta` are the stored records (with their owner, which clients never see);
`file_object` / `batch_object` render OpenAI's `file` and `batch` objects from them. Statuses and
their order follow OpenAI's Batch API: validating → in_progress → finalizing → completed, or
failed (the input did not validate), expired (the completion window passed), cancelling →
cancelled.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

from pydantic import TypeAdapter, ValidationError

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FilePurpose = Literal["batch", "batch_output"]

ENDPOINTS: Final[dict[str, str]] = {  # batch endpoint -> the API kind its lines are
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}
FINISHED: Final[frozenset[str]] = frozenset({"failed", "completed", "expired", "cancelled"})
RUNNING: Final[frozenset[str]] = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
COMPLETION_WINDOW: Final = "24h"
MAX_LINES: Final = 10_000_000  # the most `batch.max_lines` may be: a stored total past it is no total


_ID_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


def _is_id(value: str, prefix: str) -> bool:
    return value.startswith(prefix) and len(prefix) < len(value) <= 64 and _ID_CHARS.issuperset(value[len(prefix) :])


def is_file_id(value: str) -> bool:
    """Whether `value` can be one of the gateway's file ids: anything else is looked up nowhere, so a
    client's string never becomes part of a store key (`<id>:data` would name another record)."""
    return _is_id(value, "file-")


def is_batch_id(value: str) -> bool:
    return _is_id(value, "batch_")


def new_file_id() -> str:
    """96 random bits: ids are the gateway's own, never derived from anything a client sent."""
    return "file-" + os.urandom(12).hex()


def new_batch_id() -> str:
    return "batch_" + os.urandom(12).hex()


def new_line_result_id() -> str:
    return "batch_req_" + os.urandom(12).hex()


@dataclass(slots=True)
class FileMeta:
    id: str
    owner: str  # the key id that uploaded it (or whose batch wrote it)
    tenant: str
    filename: str
    purpose: FilePurpose
    bytes: int
    created_at: int
    expires_at: int | None
    lines: int = 0  # requests (non-blank lines)
    urls: dict[str, int] = field(default_factory=dict)  # url -> first line using it (1-based)
    models: dict[str, int] = field(default_factory=dict)  # body.model -> first line using it
    seq: int = 0  # order of creation within the store (list order for equal created_at)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FileMeta:
        return cls(**data)


def file_object(meta: FileMeta) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": "file",
        "bytes": meta.bytes,
        "created_at": meta.created_at,
        "expires_at": meta.expires_at,
        "filename": meta.filename,
        "purpose": meta.purpose,
        "status": "processed",
        "status_details": None,
    }


@dataclass(slots=True)
class Counts:
    """Per-line progress: lines with a recorded result, and what they used."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def recorded(self) -> int:
        return self.completed + self.failed

    def as_list(self) -> list[int]:
        return [self.completed, self.failed, self.input_tokens, self.cached_tokens, self.output_tokens]

    def add(self, ok: bool, usage: tuple[int, int, int]) -> None:
        if ok:
            self.completed += 1
        else:
            self.failed += 1
        self.input_tokens += usage[0]
        self.cached_tokens += usage[1]
        self.output_tokens += usage[2]


@dataclass(slots=True)
class BatchMeta:
    id: str
    owner: str
    tenant: str
    endpoint: str
    input_file_id: str
    created_at: int
    expires_at: int
    total: int
    status: BatchStatus = "validating"
    completion_window: str = COMPLETION_WINDOW
    metadata: dict[str, str] | None = None
    model: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # validation errors: {code, line, message, param}
    final_counts: list[int] | None = None  # a finished batch's Counts (its per-line records are gone)
    output_ttl_s: float | None = None  # output_expires_after.seconds (None: batch.file_ttl_s)
    seq: int = 0

    @property
    def api(self) -> str:
        return ENDPOINTS[self.endpoint]

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def finished_at(self) -> int | None:
        return self.completed_at or self.failed_at or self.expired_at or self.cancelled_at

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchMeta:
        return cls(**data)


def batch_object(meta: BatchMeta, counts: Counts) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": "batch",
        "endpoint": meta.endpoint,
        "model": meta.model,
        "errors": {"object": "list", "data": meta.errors} if meta.errors else None,
        "input_file_id": meta.input_file_id,
        "completion_window": meta.completion_window,
        "status": meta.status,
        "output_file_id": meta.output_file_id,
        "error_file_id": meta.error_file_id,
        "created_at": meta.created_at,
        "in_progress_at": meta.in_progress_at,
        "expires_at": meta.expires_at,
        "finalizing_at": meta.finalizing_at,
        "completed_at": meta.completed_at,
        "failed_at": meta.failed_at,
        "expired_at": meta.expired_at,
        "cancelling_at": meta.cancelling_at,
        "cancelled_at": meta.cancelled_at,
        "request_counts": {"total": meta.total, "completed": counts.completed, "failed": counts.failed},
        "usage": {
            "input_tokens": counts.input_tokens,
            "input_tokens_details": {"cached_tokens": counts.cached_tokens},
            "output_tokens": counts.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.input_tokens + counts.output_tokens,
        },
        "metadata": meta.metadata,
    }


def page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: the next page is `?after=<last id>`."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


# What a shared store holds is read as input: another replica's version, a hand edit or a restore can
# leave anything there (bench/chaos/state_fuzz.py). Each record is validated whole, strictly (a count
# that is text, a status that is none of the API's, an endpoint tokenway does not batch are refused),
# so a record that is not one reads as absent instead of failing a listing or a runner later on.
_FILE_META: Final = TypeAdapter(FileMeta)
_BATCH_META: Final = TypeAdapter(BatchMeta)


def read_file_meta(raw: bytes | str) -> FileMeta | None:
    """A stored file record, or None for bytes that are not one."""
    try:
        meta = _FILE_META.validate_json(raw, strict=True)
    except ValidationError:
        return None
    return meta if meta.bytes >= 0 and 0 <= meta.lines <= MAX_LINES else None


def read_batch_meta(raw: bytes | str) -> BatchMeta | None:
    """A stored batch record, or None for bytes that are not one."""
    try:
        meta = _BATCH_META.validate_json(raw, strict=True)
    except ValidationError:
        return None
    return meta if meta.endpoint in ENDPOINTS and 0 <= meta.total <= MAX_LINES else None

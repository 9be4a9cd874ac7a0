"""Flow control's vocabulary: what a request brings to the waiting room, what it gets back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from policies.flow.rejections import REASON_QUEUE_FULL, REASON_QUEUE_TIMEOUT, REASON_SHED

T = TypeVar("T")

__all__ = ["REASON_QUEUE_FULL", "REASON_QUEUE_TIMEOUT", "REASON_SHED", "Blocked", "FlowRequest", "QueueRejected"]


class Blocked(Enum):
    """Why a waiting request cannot go now (what a `Ready` callable answers instead of a value)."""

    POOL = "pool"  # the pool is saturated: nobody waiting there can go
    REQUEST = "request"  # this request cannot (its SLO, say); the next one may
    TENANT = "tenant"  # no request of this tenant can (the slot reserve); another tenant's may
    PROGRAM = "program"  # no request of this program can (the program slot reserve); another program's may


Ready = Callable[[], "T | Blocked"]


@dataclass(frozen=True, slots=True)
class FlowRequest:
    """A request as the waiting room sees it.

    `cost_tokens`: uncached prompt + predicted output tokens (what its tenant's counter is charged);
    `deadline_s`: `time.monotonic()` past which it stops waiting; `tag`: a group whose waiting
    requests can be counted (`FlowQueue.waiting_with`), e.g. its SLO class; `resumed`: a stream
    flow control cut to free its slot, waiting to continue (it was admitted before any of its
    tenant's that wait, so it goes first of them); `batch`: a batch line (not counted among the
    interactive requests waiting, `FlowQueue.interactive_depth`); `program`: the agent program it
    belongs to (gateway/request/program.py; None: it names none), what program-fair queueing orders
    a tenant's requests by."""

    request_id: str
    tenant: str
    band: int
    cost_tokens: float
    weight: float
    deadline_s: float
    body_bytes: int = 0
    tag: str = ""
    resumed: bool = False  # a preempted stream waiting again: first of its tenant's, as the earliest arrival
    batch: bool = False
    program: str | None = None


class QueueRejected(Exception):
    """The request leaves the waiting room without being dispatched.

    `reason`: queue_full | queue_timeout | queue_shed; `blocked`: what held it last (None when it was
    never tried); `retry_after_s`: from the room's recent drain rate."""

    def __init__(self, reason: str, *, waited_s: float, retry_after_s: int, blocked: Blocked | None) -> None:
        super().__init__(f"{reason} after {waited_s * 1000:.0f} ms")
        self.reason = reason
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s
        self.blocked = blocked

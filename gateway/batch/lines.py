"""One batch line as the walk serves it, and what its answer means for the line.

`RunLine` is the one function between the batch runner and the request walk: it takes a line (its
API, body and the principal of the key that created the batch) and returns the answer a client
would have got — status, body, headers. The runner then decides, by `classify`:

- `done`: record it (2xx to the output file; a 4xx, or a 5xx after `max_attempts`, to the error
  file: what the line asked for cannot be served);
- `later`: the answer says "not now" — rate limited (429), budget exhausted, no spare capacity for
  batch work, no healthy endpoint or an SLO/queue 503 — so the line goes back, to be claimed again
  after the answer's retry-after (bounded), and counts nowhere yet;
- `retry`: the upstream failed (5xx): back, with backoff, counted as an attempt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from policies.types import Principal

Verdict = Literal["done", "later", "retry"]

# The batch gate's answer when no endpoint of the pool has spare capacity for batch work.
NO_SPARE_CAPACITY: Final = "batch_no_spare_capacity"
_LATER_CODES: Final = frozenset({"rate_limit_exceeded", "insufficient_quota", NO_SPARE_CAPACITY})


@dataclass(frozen=True, slots=True)
class LineRequest:
    batch_id: str
    index: int
    custom_id: str
    api: str  # chat | completions | embeddings | responses
    body: dict[str, Any]
    principal: Principal
    request_id: str


@dataclass(frozen=True, slots=True)
class LineAnswer:
    status: int
    body: bytes
    headers: Mapping[str, str]
    code: str | None = None  # the error code, when the walk refused it


class RunLine(Protocol):
    async def __call__(self, line: LineRequest) -> LineAnswer: ...


def classify(answer: LineAnswer) -> Verdict:
    if 200 <= answer.status < 300:
        return "done"
    if answer.code in _LATER_CODES or answer.status in (429, 503, 408):
        return "later"
    if answer.status >= 500:
        return "retry"
    return "done"


def retry_after_s(answer: LineAnswer) -> float | None:
    """The answer's own retry-after (ms precision when given), if any."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = answer.headers.get(name)
        if raw is None:
            continue
        try:
            return max(float(raw) * scale, 0.0)
        except ValueError:
            continue
    return None

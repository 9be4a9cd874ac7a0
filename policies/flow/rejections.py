"""What a request that leaves a waiting room undispatched is told (the error catalogue's queue rows).

- waited its band's `max_queue_ms`: 429 `rate_limit_exceeded` (type `requests`) or 503 `server_error`
  / `queue_timeout`, as the band's `on_timeout` says (`fallback` answers 503 when no chain step
  takes the trigger `queue_timeout`);
- no room even after shedding lower bands: 503 `queue_full`;
- displaced by a higher band: 503 `queue_shed`.

Each carries `retry-after` / `retry-after-ms` from the room's drain rate; `reason` is what the usage
record and the metrics count (load-shedding reasons).
"""

from __future__ import annotations

from typing import Final

from policies.types import Rejection

REASON_QUEUE_FULL: Final = "queue_full"
REASON_QUEUE_TIMEOUT: Final = "queue_timeout"
REASON_SHED: Final = "queue_shed"

_WHY: Final = {
    REASON_QUEUE_TIMEOUT: "waited {waited:.0f} ms in the {band} band's queue, its limit",
    REASON_QUEUE_FULL: "found the queue full",
    REASON_SHED: "was displaced from the queue by higher-priority traffic after {waited:.0f} ms",
}


def queue_rejection(
    reason: str, *, model: str, band: str, waited_ms: float, retry_after_s: int, status: int = 503
) -> Rejection:
    """The answer to a request leaving the queue for `reason` (status 429 or 503 for a timeout)."""
    why = _WHY.get(reason, "left the queue").format(waited=waited_ms, band=band)
    message = f"The engines serving '{model}' are saturated and this request {why}. Retry in {retry_after_s} s."
    headers = (("retry-after", str(retry_after_s)), ("retry-after-ms", str(retry_after_s * 1000)))
    if status == 429 and reason == REASON_QUEUE_TIMEOUT:
        return Rejection(429, message, "requests", "rate_limit_exceeded", headers=headers, reason=reason)
    return Rejection(503, message, "server_error", reason, headers=headers, reason=reason)

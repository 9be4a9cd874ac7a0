"""Bucket arithmetic shared by the memory store, the Redis script's mirror and the headers.

A bucket holds `used` (tokens or requests consumed) that drains continuously at `rate_per_s`; a
request fits when `used + cost <= capacity`. Storing what is used rather than what is left keeps a
reload that changes the capacity meaningful (consumption is kept) and lets a reconciled charge push
`used` past capacity (debt), which then delays later requests by exactly the overrun. reserve.lua
implements the same formulas; the tests hold both to them.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime


def drained(used: float, updated_at_s: float, now_s: float, rate_per_s: float) -> float:
    """`used` after draining from `updated_at_s` to `now_s` (never below zero; a clock step back is ignored)."""
    if now_s <= updated_at_s:
        return used
    left = used - (now_s - updated_at_s) * rate_per_s
    return left if left > 0.0 else 0.0


def wait_s(used: float, cost: float, capacity: float, rate_per_s: float) -> float:
    """Seconds until `cost` fits, with no other traffic; inf when it exceeds the whole capacity."""
    if cost > capacity:
        return math.inf
    over = used + cost - capacity
    return over / rate_per_s if over > 0.0 else 0.0


def reset_s(used: float, rate_per_s: float) -> float:
    """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-* meaning)."""
    return used / rate_per_s if used > 0.0 else 0.0


def period_id(period: str, now_s: float) -> int:
    """Calendar period index (UTC): days since the epoch, or months since year 0 (`y*12 + m-1`)."""
    if period == "day":
        return int(now_s // 86_400)
    moment = datetime.fromtimestamp(now_s, UTC)
    return moment.year * 12 + moment.month - 1


def period_end_s(period: str, pid: int) -> float:
    """Epoch seconds at which period `pid` ends (when its budget resets)."""
    if period == "day":
        return (pid + 1) * 86_400.0
    year, month0 = divmod(pid + 1, 12)
    return datetime(year, month0 + 1, 1, tzinfo=UTC).timestamp()


def period_ttl_s(period: str) -> int:
    """How long a budget counter outlives its last write (longer than any period)."""
    return 2 * 86_400 if period == "day" else 32 * 86_400

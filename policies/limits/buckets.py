"""Bucket arithmetic shared by the memory store, the Redis script's mirror and the headers.

A bucket holds `used` (tokens or requests consumed) that drains continuously at `rate_per_s`; a
request fits when `used + cost <= capacity`. Storing what is used rather than what is left keeps a
reload that changes the capacity meaningful (consumption is kept) and lets a reconciled charge push
`used` past capacity (debt), which then delays later requests by exactly the overrun. reserve.lua
implements the same formulas; the tests hold both to them.
"""

from __future__ import annotations

import functools
import math
from datetime import UTC, datetime


def drained(used: float, updated_at_s: float, now_s: float, rate_per_s: float) -> float:
    """`used` after draining from `updated_at_s` to `now_s` (never below zero; a clock step back is ignored)."""
    if now_s <= updated_at_s:
        return used
    left = used - (now_s - updated_at_s) * rate_per_s
    return left if left > 0.0 else 0.0


# A counter that never drains or resets (an agent run's caps and budget) is forgotten this long after
# its last write: the Redis scripts' expiry, and the memory store's sweep.
IDLE_TTL_S = 32 * 86_400


def wait_s(used: float, cost: float, capacity: float, rate_per_s: float) -> float:
    """Seconds until `cost` fits, with no other traffic; inf when it exceeds the whole capacity or
    the bucket never drains."""
    if cost > capacity:
        return math.inf
    over = used + cost - capacity
    if over <= 0.0:
        return 0.0
    return over / rate_per_s if rate_per_s > 0.0 else math.inf


def reset_s(used: float, rate_per_s: float) -> float:
    """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-* meaning); inf for one that
    never drains."""
    if used <= 0.0:
        return 0.0
    return used / rate_per_s if rate_per_s > 0.0 else math.inf


def period_id(period: str, now_s: float) -> int:
    """Calendar period index (UTC): days since the epoch, months since year 0 (`y*12 + m-1`), or 0
    for an agent run's budget (one period that never ends)."""
    day = int(now_s // 86_400)
    if period == "day":
        return day
    if period == "run":
        return 0
    if period[0] == "b":  # billing:<anchor day>:<UTC offset s>
        anchor, offset = billing_of(period)
        moment = datetime.fromtimestamp(now_s + offset, UTC)  # the wall clock of the period's zone
        month = moment.year * 12 + moment.month - 1
        return month if moment.day >= anchor else month - 1
    if day != _month_of[0]:  # one calendar conversion per day, not one per budget per request
        moment = datetime.fromtimestamp(now_s, UTC)
        _month_of[:] = [day, moment.year * 12 + moment.month - 1]
    return _month_of[1]


_month_of: list[int] = [-1, 0]  # [day number, its month index]: period_id's cache of one day


def period_end_s(period: str, pid: int) -> float:
    """Epoch seconds at which period `pid` ends (when its budget resets); inf for a run's."""
    if period == "day":
        return (pid + 1) * 86_400.0
    if period == "run":
        return math.inf
    year, month0 = divmod(pid + 1, 12)
    if period[0] == "b":
        anchor, offset = billing_of(period)
        return datetime(year, month0 + 1, anchor, tzinfo=UTC).timestamp() - offset
    return datetime(year, month0 + 1, 1, tzinfo=UTC).timestamp()


@functools.cache
def billing_of(period: str) -> tuple[int, int]:
    """(anchor day, UTC offset in seconds) of a `billing:<day>:<offset>` period (policies' BillingPeriod):
    period `y*12 + m-1` starts on day `anchor` of month m at 00:00 in the zone, the Redis scripts alike."""
    _, day, offset = period.split(":")
    return int(day), int(offset)


def period_ttl_s(period: str) -> int:
    """How long a budget counter outlives its last write (longer than any period)."""
    return 2 * 86_400 if period == "day" else IDLE_TTL_S

"""Priority bands: a request's band is its principal's priority; a higher band always goes first.

Bands are ranked 0 (critical) to 4 (sheddable) so that sorting by rank is dispatch order.
"""

from __future__ import annotations

from typing import Final

from policies.schema import PRIORITY_VALUES

BANDS: Final = ("critical", "high", "normal", "low", "sheddable")  # dispatch order
_RANK_BY_PRIORITY: Final = {PRIORITY_VALUES[name]: rank for rank, name in enumerate(BANDS)}


def band_rank(priority: int) -> int:
    """The band of a principal's priority (priorities outside the named ones clamp to the ends)."""
    found = _RANK_BY_PRIORITY.get(priority)
    if found is not None:
        return found
    return 0 if priority > PRIORITY_VALUES["critical"] else len(BANDS) - 1


def band_name(rank: int) -> str:
    return BANDS[rank]

"""Bounded label values: one guard per label dimension so no client input can grow the series count.

Tenants, models, pools and endpoints are bounded by configuration, but some values reach a label
from the client (an unknown model name on a 404, say). A guard passes values from its allow-list
(when one is set) or, without one, the first `max_values` distinct values; everything else becomes
`OTHER`. Values are cut to `MAX_VALUE_CHARS` before anything else, so the memo of values seen is
bounded in bytes too (at most 4 x `max_values` entries of at most `MAX_VALUE_CHARS` characters).
"""

from __future__ import annotations

from collections.abc import Iterable

OTHER = "other"
MAX_VALUE_CHARS = 128


class LabelGuard:
    __slots__ = ("_allowed", "_max_values", "_seen", "overflowed")

    def __init__(self, max_values: int, allowed: Iterable[str] | None = None) -> None:
        self._max_values = max_values
        self._allowed: frozenset[str] | None = None
        self._seen: dict[str, str] = {}
        self.overflowed = 0  # values folded into OTHER (a hint that an allow-list or the cap is wrong)
        self.allow(allowed)

    def allow(self, allowed: Iterable[str] | None) -> None:
        """Replace the allow-list (None = first come, up to the cap); forgets values seen so far."""
        self._allowed = frozenset(allowed) if allowed is not None else None
        self._seen = {}

    def __len__(self) -> int:
        """Values in the memo (admitted and refused): at most 4 x `max_values`."""
        return len(self._seen)

    @property
    def memo_chars(self) -> int:
        """Characters held by the memo's keys: at most `len(self)` x `MAX_VALUE_CHARS`."""
        return sum(map(len, self._seen))

    def __call__(self, value: str) -> str:
        if len(value) > MAX_VALUE_CHARS:
            value = value[:MAX_VALUE_CHARS]
        found = self._seen.get(value)
        if found is not None:
            return found
        return self._admit(value)

    def _admit(self, value: str) -> str:
        if self._allowed is not None:
            admitted = value if value in self._allowed or value == "" else OTHER
        elif len(self._seen) < self._max_values:
            admitted = value
        else:
            admitted = OTHER
        if admitted == OTHER:
            self.overflowed += 1
            if len(self._seen) >= 4 * self._max_values:
                return OTHER  # do not let rejected values grow the memo either
        self._seen[value] = admitted
        return admitted

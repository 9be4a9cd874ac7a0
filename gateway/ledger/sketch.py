"""Percentiles of a stream in bounded memory: exact for the first values, a log histogram after.

A group keeps its TTFTs exactly (and its percentiles are numpy's linear interpolation between
ranks) until it holds `exact_up_to` of them; then they move into a histogram of logarithmic bins
(the bin of x is ceil(log_gamma x), gamma = (1 + a) / (1 - a)), and a percentile is the midpoint of
the bin holding that rank: within relative error `a` of a value of the stream at that rank
(DDSketch's guarantee: Masson, Rim and Lee, VLDB 2019). Memory is then one counter per occupied
bin: TTFTs between 1 ms and 10 min occupy at most ~670 bins at a = 1 %, whatever the row count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

RELATIVE_ACCURACY = 0.01
EXACT_UP_TO = 10_000


class QuantileSketch:
    __slots__ = ("_bins", "_count", "_exact", "_exact_up_to", "_gamma_ln", "_zeros")

    def __init__(self, exact_up_to: int = EXACT_UP_TO, relative_accuracy: float = RELATIVE_ACCURACY) -> None:
        self._exact: list[float] | None = []
        self._exact_up_to = exact_up_to
        self._gamma_ln = math.log((1 + relative_accuracy) / (1 - relative_accuracy))
        self._bins: dict[int, int] = {}
        self._zeros = 0  # values <= 0 (a clock that did not move) sit below every bin
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def exact(self) -> bool:
        return self._exact is not None

    def add(self, value: float) -> None:
        self._count += 1
        if self._exact is not None:
            self._exact.append(value)
            if len(self._exact) > self._exact_up_to:
                values, self._exact = self._exact, None
                for v in values:
                    self._bin(v)
            return
        self._bin(value)

    def _bin(self, value: float) -> None:
        if value <= 0.0:
            self._zeros += 1
            return
        index = math.ceil(math.log(value) / self._gamma_ln)
        self._bins[index] = self._bins.get(index, 0) + 1

    def merge(self, other: QuantileSketch) -> None:
        if (
            self._exact is not None
            and other._exact is not None
            and len(self._exact) + len(other._exact) <= self._exact_up_to
        ):
            self._exact.extend(other._exact)
            self._count += other._count
            return
        if self._exact is not None:
            values, self._exact = self._exact, None
            for v in values:
                self._bin(v)
        if other._exact is not None:
            for v in other._exact:
                self._bin(v)
        else:
            for index, n in other._bins.items():
                self._bins[index] = self._bins.get(index, 0) + n
            self._zeros += other._zeros
        self._count += other._count

    def quantile(self, q: float) -> float | None:
        if self._count == 0:
            return None
        if self._exact is not None:
            return percentile(sorted(self._exact), q)
        rank = q * (self._count - 1)  # the 0-based rank numpy interpolates at
        seen = self._zeros
        if rank < seen:
            return 0.0
        for index in sorted(self._bins):
            seen += self._bins[index]
            if rank < seen:
                # the bin covers (gamma^(i-1), gamma^i]; its midpoint is within the accuracy of both ends
                return 2.0 * math.exp(index * self._gamma_ln) / (1.0 + math.exp(self._gamma_ln))
        return 2.0 * math.exp(max(self._bins) * self._gamma_ln) / (1.0 + math.exp(self._gamma_ln))


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """numpy's default (linear interpolation between the ranks around q * (n - 1))."""
    if not sorted_values:
        return None
    rank = (len(sorted_values) - 1) * q
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)

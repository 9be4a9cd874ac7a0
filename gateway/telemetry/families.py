"""Lean counter and histogram families for the per-request hot path, rendered by prometheus_client,
and the label guards that keep their series bounded.

The families are what every series is built of; the guards are what keeps their label values
bounded. Both serve every metrics module (`metrics.py`, the OTLP push in `tracing.py`, the batch
API's), and neither knows any series by name.

Lean families
-------------

prometheus_client's own children take a lock per update (about 0.7 µs per counter increment and
1.6 µs per histogram observation here); one request touches a dozen series. These children are
plain slotted objects updated from the event loop thread only, and a `Collector` turns them into
ordinary metric families at scrape time, so the exposition format is still prometheus_client's.

Contract: updates come from one thread (the event loop). A scrape from another thread may see a
histogram whose bucket counts and sum are one observation apart; it never sees a torn number.

Label guards
------------

One guard per label dimension so no client input can grow the series count.

Tenants, models, pools and endpoints are bounded by configuration, but some values reach a label
from the client (an unknown model name on a 404, say). A guard passes values from its allow-list
(when one is set) or, without one, the first `max_values` distinct values; everything else becomes
`OTHER`. Values are cut to `MAX_VALUE_CHARS` before anything else, so the memo of values seen is
bounded in bytes too (at most 4 x `max_values` entries of at most `MAX_VALUE_CHARS` characters).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

# ---- Lean families


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    """Non-cumulative bucket counts (last slot is +Inf), made cumulative only when rendered."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, i.e. Prometheus' `le` semantics.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class CounterFamily:
    """`otel_name`/`unit` name the family in the OTLP export (tracing.py)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], *, otel_name: str = "", unit: str = ""
    ) -> None:
        self.name = name.removesuffix("_total")
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.otel_name = otel_name or self.name
        self.unit = unit
        self._children: dict[tuple[str, ...], CounterChild] = {}

    def points(self) -> list[tuple[tuple[str, ...], float]]:
        """(label values, value) of every child, for the OTLP export."""
        return [(labelvalues, child.value) for labelvalues, child in list(self._children.items())]

    def child(self, *labelvalues: str) -> CounterChild:
        found = self._children.get(labelvalues)
        if found is None:
            if len(labelvalues) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {labelvalues}")
            found = self._children[labelvalues] = CounterChild()
        return found

    def remove(self, *labelvalues: str) -> None:
        """Drop one series (a short-lived label value leaving the exposition); absent is fine."""
        self._children.pop(labelvalues, None)

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labelvalues, child in list(self._children.items()):
            family.add_metric(labelvalues, child.value)
        return family


class HistogramFamily:
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        *,
        otel_name: str = "",
        unit: str = "",
    ) -> None:
        bounds = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))
        if not bounds:
            raise ValueError(f"{name}: needs at least one finite bucket")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.otel_name = otel_name or name
        self.unit = unit
        self.bounds = bounds
        self._le = [_format_le(b) for b in bounds] + ["+Inf"]
        self._children: dict[tuple[str, ...], HistogramChild] = {}

    def child(self, *labelvalues: str) -> HistogramChild:
        found = self._children.get(labelvalues)
        if found is None:
            if len(labelvalues) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {labelvalues}")
            found = self._children[labelvalues] = HistogramChild(self.bounds)
        return found

    def points(self) -> list[tuple[tuple[str, ...], list[int], float]]:
        """(label values, non-cumulative bucket counts with +Inf last, sum) of every child."""
        return [(labelvalues, list(child.counts), child.sum) for labelvalues, child in list(self._children.items())]

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labelvalues, child in list(self._children.items()):
            running = 0
            buckets: list[tuple[str, float]] = []
            for le, count in zip(self._le, list(child.counts), strict=True):
                running += count
                buckets.append((le, float(running)))
            family.add_metric(labelvalues, buckets, child.sum)
        return family


Family = CounterFamily | HistogramFamily


class FamiliesCollector:
    """A prometheus_client collector over a fixed list of lean families."""

    def __init__(self, families: Sequence[Family]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.collect()

    def describe(self) -> list[Metric]:
        # Declared names let the registry reject a duplicate family at registration time.
        out: list[Metric] = []
        for family in self._families:
            if isinstance(family, CounterFamily):
                out.append(CounterMetricFamily(family.name, family.documentation, labels=family.labelnames))
            else:
                out.append(HistogramMetricFamily(family.name, family.documentation, labels=family.labelnames))
        return out


def _format_le(bound: float) -> str:
    # The same text prometheus_client writes for its own histograms.
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call, unused-ignore]


# ---- Label guards

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

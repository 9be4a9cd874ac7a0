"""A minimal reader of the Prometheus text exposition format (0.0.4), for scraping engines.

Why not `prometheus_client.parser`: it builds every family of every histogram, and an engine's
`/metrics` is mostly histograms we never read; scraping each endpoint four times a second should cost
microseconds. This reader scans lines, keeps only the requested metric names, and parses labels only
for those.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection

Sample = tuple[dict[str, str], float]

_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_samples(text: str, wanted: Collection[str]) -> dict[str, list[Sample]]:
    """Samples of the `wanted` metric names: name -> [(labels, value)], in exposition order.

    Lines that are comments, malformed, or of other metrics are skipped; a value that is not a float
    (or is NaN) drops the sample. Timestamps after the value are ignored.
    """
    found: dict[str, list[Sample]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            if name not in wanted:
                continue
            close = line.rfind("}")
            if close < brace:
                continue
            labels = _parse_labels(line[brace + 1 : close])
            rest = line[close + 1 :]
        else:
            if space == -1:
                continue
            name = line[:space]
            if name not in wanted:
                continue
            labels = {}
            rest = line[space:]
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        found.setdefault(name, []).append((labels, value))
    return found


def _parse_labels(body: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    for match in _LABEL.finditer(body):
        value = match.group(2)
        if "\\" in value:
            value = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)
        labels[match.group(1)] = value
    return labels


def first_present(samples: dict[str, list[Sample]], names: Collection[str]) -> list[Sample] | None:
    """The samples of the first name in `names` that the payload has (new names before old ones)."""
    for name in names:
        if name in samples:
            return samples[name]
    return None


def total(samples: list[Sample] | None) -> float | None:
    """Sum over label sets (engines report one series per data-parallel rank)."""
    return None if samples is None else sum(v for _, v in samples)


def mean(samples: list[Sample] | None) -> float | None:
    return None if not samples else sum(v for _, v in samples) / len(samples)

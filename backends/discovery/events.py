"""What a watch tells the pool's discovery (plain values: no client types cross the thread)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Reset:
    """A fresh list: these slices are all there is."""

    slices: tuple[dict[str, Any], ...]
    resource_version: str


@dataclass(frozen=True, slots=True)
class Upsert:
    slice: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Delete:
    name: str


@dataclass(frozen=True, slots=True)
class Failure:
    """The list or watch failed; the watch retries by itself."""

    reason: str


WatchEvent = Reset | Upsert | Delete | Failure

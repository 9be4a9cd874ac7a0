"""`/metrics` of a group of workers: whichever worker a scrape reaches answers for all of them.

Each worker's registry holds its own share of the traffic (the kernel spread the connections), so a
scrape of one would read 1/N of the group and a different 1/N each time. The gateway's metrics are its
own collectors over a private registry, not prometheus_client's multiprocess mode, so the group is
merged here instead: every worker serves its own exposition on a Unix socket in the group's private
directory (connect, read to the end: no protocol), and the worker answering `/metrics` reads its
siblings' and merges them, off the event loop.

How each family is merged:

- counters, histograms and summaries are sums: `_total`, `_bucket`, `_count`, `_sum` add up over the
  workers (a histogram's buckets are the same everywhere: the same code made them); `_created` is
  the earliest;
- gauges (and info, state sets, untyped) are not summable in general (an engine's KV usage scraped by
  every worker is one number, not N): each worker's sample is kept with a `worker` label, so
  `sum without (worker)` gives a group total where one makes sense (requests in flight) and
  `max without (worker)` a shared reading.

Two gauges describe the merge itself: `tokenway_workers` (the group's size) and
`tokenway_workers_scraped` (workers whose exposition is in this answer; a restarting worker is missing
for a moment, and its counters restart from zero: Prometheus' `rate()` reads that as a counter reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger("tokenway.workers")

SUMMED_TYPES = frozenset({"counter", "histogram", "summary"})
FETCH_TIMEOUT_S = 2.0
MAX_EXPOSITION_BYTES = 64 * 1024 * 1024  # a sibling's answer is bounded like any body


def socket_path(directory: Path, index: int) -> Path:
    return directory / f"metrics-{index}.sock"


def merge_expositions(texts: Sequence[tuple[int, str]], workers: int) -> bytes:
    """One exposition from each worker's (index, text): see the module's docstring for the rules."""
    families: dict[str, Metric] = {}
    summed: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    summed_bases: set[str] = set()  # counters, histograms, summaries (their `_created` series follow them)
    for index, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                summed[family.name] = {}
            created_of_summed = family.name.endswith("_created") and family.name[: -len("_created")] in summed_bases
            if family.type in SUMMED_TYPES:
                summed_bases.add(family.name)
            elif not created_of_summed:
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "worker": str(index)}, sample.value)
                continue
            values = summed[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in values:
                    values[key] = sample.value
                elif sample.name.endswith("_created"):
                    values[key] = min(values[key], sample.value)
                else:
                    values[key] += sample.value
    for name, values in summed.items():
        for (sample_name, labels), value in values.items():
            families[name].add_sample(sample_name, dict(labels), value)
    group = Metric("tokenway_workers", "Gateway processes in this group (server.workers).", "gauge")
    group.add_sample("tokenway_workers", {}, float(workers))
    scraped = Metric("tokenway_workers_scraped", "Workers whose metrics are merged into this answer.", "gauge")
    scraped.add_sample("tokenway_workers_scraped", {}, float(len(texts)))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), group, scraped]))
    return generate_latest(registry)


async def _read_to_end(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await reader.read(1 << 16):
        size += len(chunk)
        if size > MAX_EXPOSITION_BYTES:
            raise ValueError("a sibling's exposition is over the bound")
        chunks.append(chunk)
    return b"".join(chunks)


class _Fixed(Collector):
    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self._metrics


class GroupMetrics:
    """One worker's side: its exposition served to its siblings, and the group's merged on demand."""

    def __init__(self, directory: Path, index: int, workers: int, render: Callable[[], bytes]) -> None:
        self.directory = directory
        self.index = index
        self.workers = workers
        self.render = render
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        path = socket_path(self.directory, self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by this worker's previous run (a restart)
        self._server = await asyncio.start_unix_server(self._serve_own, path=str(path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            socket_path(self.directory, self.index).unlink()

    async def _serve_own(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(self.render())
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _fetch(self, index: int) -> tuple[int, str] | None:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(socket_path(self.directory, index)), limit=1 << 20),
                FETCH_TIMEOUT_S,
            )
        except (OSError, TimeoutError):
            return None  # restarting, or gone: the answer says how many workers it covers
        try:
            data = await asyncio.wait_for(_read_to_end(reader), FETCH_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError):
            return None
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
        return index, data.decode("utf-8", errors="replace")

    async def render_group(self) -> bytes:
        """The group's metrics: this worker's own and every sibling that answers, merged."""
        own = (self.index, self.render().decode("utf-8", errors="replace"))
        others = await asyncio.gather(*(self._fetch(i) for i in range(self.workers) if i != self.index))
        texts = [own, *(t for t in others if t is not None)]
        texts.sort(key=lambda item: item[0])
        return await asyncio.to_thread(merge_expositions, texts, self.workers)

"""What the fleet's engines report, and the fleet shown back: metrics scraped into `EndpointStats`, the
LoRA adapters each engine lists, both asked inside `watch`; and the status of every pool and
endpoint for `GET /admin/backends` and `tokenway pools status`.

Metrics
-------
Metrics scraping: each endpoint's engine metrics, parsed by its adapter into `EndpointStats`.

Every `scrape_interval_s` (250 ms by default: load routing is blind with slow or renamed metrics, as
production-stack's 30 s scrapes in `src/vllm_router/stats/engine_stats.py` were) each READY or
DRAINING endpoint gets one GET, as its own task so a slow engine delays no other and never two at
once. A successful scrape replaces `endpoint.stats` with
`scraped_at_s = now`; a failed one leaves the old stats to age, and stats older than
`stats_max_age_s` count as saturated for routing (`is_stale`). Endpoints whose engine exports no
metrics (remote APIs) are stamped fresh each tick: their load is the gateway's own accounting.

An engine's metrics are input. The body is read up to `MAX_METRICS_BYTES` (a longer one is not
parsed); whatever the adapter's parse raises is an unusable scrape (counted per endpoint in
`Scraper.unusable`, a warning the first time, the old stats left to age), never a task that dies
with a traceback; and what an adapter made of the text passes `bounded_stats` before routing, the
autoscaler or the predictor read it: counts and counters finite, non-negative and bounded, the KV
usage a ratio in 0..1, block sizes and counts in range or unknown, every map and set keyed by the
engine's label values capped in entries and name length. (The Prometheus reader itself drops
samples that are not finite numbers: `backends.adapters.base.parse_samples`.)

Listed LoRA adapters
--------------------
Which LoRA adapters each engine holds, read from the engine itself: `GET /v1/models`.

The gateway knows the adapters it loaded; an engine may hold others: a static endpoint started with
`--lora-modules`, adapters another gateway (or an operator) loaded, or none of those it loaded after a
restart. vLLM lists every registered adapter in `/v1/models` beside the base model, with the base
model as `parent` (docs.vllm.ai, "LoRA Adapters", serving adapters: the models list shows each
adapter with `"parent"` naming its base); the base model's own entry has `parent: null`.

Every `lora_discovery_interval_s` each READY or DRAINING endpoint of a vLLM-compatible engine whose
pool serves the base model of some declared adapter gets one GET (its own task, as scrapes are: a slow
engine delays no other). The answer sets `Endpoint.loras` (the adapter names) and `loras_at_s` (when
the request was sent: a registration made after it may not be listed yet). Routing reads it
(`policies/routing/lora.py`: a listed adapter needs no load) and the loader trusts it (a listed adapter
is not loaded again; one it loaded before `loras_at_s` and no longer listed is loaded again).

Bounded: a body of at most `MAX_LISTING_BYTES`, at most `MAX_LISTED` names per endpoint, each of at
most `MAX_NAME_CHARS` (longer ids, and ids or parents that are not strings, are skipped); an answer
that is not a models list leaves `Endpoint.loras` as it was. Endpoints are the fleet's.

Status
------
What operators see of the fleet: `GET /admin/backends` (JSON) and `tokenway pools status` (a table).

`fleet_status` is a plain snapshot (no I/O: log tails were captured when a replica failed), so the
admin route can call it on the event loop; `format_status` renders the same dict, so the CLI can
print what it fetched from a running gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp
import orjson

from backends.config import BackendsSettings
from backends.fleet import EndpointTasks, Fleet, get_adapter
from backends.fleet import run as run_health
from backends.types import Endpoint, EndpointState, EndpointStats

log = logging.getLogger(__name__)

SCRAPED_STATES = frozenset({EndpointState.READY, EndpointState.DRAINING})

# Bounds on what an engine reports (the module docstring). A vLLM /metrics is 50-200 KiB (its
# histograms, per data-parallel rank and LoRA label); 4 MiB leaves room for big fleets of labels
# while one scrape's parse stays in the milliseconds.
MAX_METRICS_BYTES = 4 << 20
MAX_ENGINE_REQUESTS = 1_000_000  # running / waiting: engines run ~10^3 sequences and queue ~10^5
MAX_COUNTER = float(1 << 53)  # as `backends.adapters.base.MAX_SAMPLE_VALUE`
MAX_BLOCK_SIZE = 1 << 16  # tokens per KV block
MAX_GPU_BLOCKS = 1 << 32
MAX_LABEL_KEYS = 16  # entries of a map keyed by an engine's label values (waiting reasons, offload directions)
MAX_NAME_CHARS = 256  # a label value or adapter id kept as a key or a name
MAX_LISTED = 4096  # names kept per endpoint (listed adapters, LoRA label lists): an answer is not trusted to be small
SLEEP_STATES = frozenset({"awake", "weights_offloaded", "discard_all", "asleep"})


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body (decompressed, as aiohttp serves it), or None once it passes `limit` bytes: a longer
    one is not read on (the connection is closed rather than drained)."""
    if response.content_length is not None and response.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _count(value: float, limit: float) -> float:
    """In 0..limit; NaN and infinities (unusable) read 0. An int is compared as an int: one past a
    float's range (10^400) would make `math.isfinite` raise."""
    if isinstance(value, int):
        return float(min(max(value, 0), limit))
    return min(max(value, 0.0), limit) if math.isfinite(value) else 0.0


def _size(value: int | None, limit: int) -> int | None:
    return value if value is not None and 0 < value <= limit else None


def _names(names: frozenset[str], limit: int = MAX_LISTED) -> frozenset[str]:
    if len(names) <= limit and all(len(name) <= MAX_NAME_CHARS for name in names):
        return names
    return frozenset(sorted(name for name in names if len(name) <= MAX_NAME_CHARS)[:limit])


def _label_map(values: Mapping[str, float], limit: float) -> dict[str, float]:
    kept: dict[str, float] = {}
    for key in sorted(values)[: 4 * MAX_LABEL_KEYS]:
        if len(key) <= MAX_NAME_CHARS and len(kept) < MAX_LABEL_KEYS:
            kept[key] = _count(values[key], limit)
    return kept


def bounded_stats(stats: EndpointStats) -> EndpointStats:
    """`stats` with every value an engine reported made safe for routing, the autoscaler and the
    predictor: no NaN, no infinity, no negative count, no ratio outside 0..1, no block size that is
    not one, no unbounded map or set. What an adapter parsed is never trusted further than this."""
    return dataclasses.replace(
        stats,
        running=int(_count(stats.running, MAX_ENGINE_REQUESTS)),
        waiting=int(_count(stats.waiting, MAX_ENGINE_REQUESTS)),
        kv_usage_ratio=_count(stats.kv_usage_ratio, 1.0),
        prefix_cache_hits_tokens=_count(stats.prefix_cache_hits_tokens, MAX_COUNTER),
        prefix_cache_queries_tokens=_count(stats.prefix_cache_queries_tokens, MAX_COUNTER),
        preemptions=_count(stats.preemptions, MAX_COUNTER),
        block_size=_size(stats.block_size, MAX_BLOCK_SIZE),
        num_gpu_blocks=_size(stats.num_gpu_blocks, MAX_GPU_BLOCKS),
        waiting_by_reason={k: int(v) for k, v in _label_map(stats.waiting_by_reason, MAX_ENGINE_REQUESTS).items()},
        prompt_tokens=_count(stats.prompt_tokens, MAX_COUNTER),
        prompt_tokens_cached=_count(stats.prompt_tokens_cached, MAX_COUNTER),
        sleep_state=stats.sleep_state if stats.sleep_state in SLEEP_STATES else None,
        running_loras=_names(stats.running_loras),
        waiting_loras=_names(stats.waiting_loras),
        max_loras=int(_count(stats.max_loras, MAX_LISTED)),
        kv_offload_bytes=_label_map(stats.kv_offload_bytes, MAX_COUNTER),
    )


def is_stale(endpoint: Endpoint, now_s: float, max_age_s: float) -> bool:
    """True when the endpoint's engine metrics are too old to trust (never scraped counts)."""
    if not get_adapter(endpoint.engine).metrics_paths:
        return False
    return endpoint.stats_age_s(now_s) > max_age_s


class Scraper:
    """Per-endpoint scraping state: which metrics path answers, which scrapes are in flight."""

    def __init__(self, settings: BackendsSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._path_index: dict[str, int] = {}
        self._tasks = EndpointTasks("scrape")
        self._warned: set[str] = set()
        self.unusable: dict[str, int] = {}  # per endpoint: scrapes answered 200 that could not be used

    async def scrape(self, endpoint: Endpoint, session: aiohttp.ClientSession) -> bool:
        """One scrape of one endpoint; True when its stats were updated."""
        adapter = get_adapter(endpoint.engine)
        paths = adapter.metrics_paths
        if not paths:
            endpoint.stats.scraped_at_s = self.clock()
            return True
        index = self._path_index.get(endpoint.id, 0)
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        try:
            async with session.get(endpoint.base_url + paths[index], timeout=timeout) as response:
                status = response.status
                body = await read_bounded(response, MAX_METRICS_BYTES) if status == 200 else b""
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("scrape %s: %r", endpoint.id, exc)
            return False
        if status == 404 and index + 1 < len(paths):
            self._path_index[endpoint.id] = index + 1  # an older build: try the next path next time
            return False
        if status != 200:
            return False
        if body is None:
            return self._unusable(endpoint, paths[index], f"a body over {MAX_METRICS_BYTES} bytes")
        try:
            # Whatever the parse raises (MetricsFormatError, a body that is not UTF-8, or a shape the
            # adapter did not foresee) is the engine's input failing, not a reason to end this task.
            stats = bounded_stats(adapter.parse_metrics(body, endpoint.stats))
        except Exception as exc:
            return self._unusable(endpoint, paths[index], f"{type(exc).__name__}: {exc}")
        stats.scraped_at_s = self.clock()
        endpoint.stats = stats
        endpoint.inflight.scraped()
        return True

    def _unusable(self, endpoint: Endpoint, path: str, why: str) -> bool:
        """Counted; a warning the first time for the endpoint; the old stats are left to age."""
        self.unusable[endpoint.id] = self.unusable.get(endpoint.id, 0) + 1
        if endpoint.id not in self._warned:
            self._warned.add(endpoint.id)
            log.warning("endpoint %s: unusable metrics at %s: %s", endpoint.id, path, why[:300])
        return False

    def tick(self, fleet: Fleet, session: aiohttp.ClientSession) -> None:
        for endpoint in fleet.endpoints():
            if endpoint.state not in SCRAPED_STATES or self._tasks.busy(endpoint.id):
                continue
            self._tasks.start(endpoint.id, self.scrape(endpoint, session))

    async def close(self) -> None:
        await self._tasks.close()


async def run(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    settings: BackendsSettings,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Scrape every endpoint's metrics every `settings.scrape_interval_s` until cancelled."""
    scraper = Scraper(settings, clock)
    try:
        while True:
            scraper.tick(fleet, session)
            await asyncio.sleep(settings.scrape_interval_s)
    finally:
        await scraper.close()


async def watch(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    settings: BackendsSettings,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """The fleet's background watch, as one task to start: active health checks, metrics scraping and
    the LoRA adapters each engine lists (`run_lora_discovery`, below) until cancelled. The gateway creates the
    upstream `ClientSession` and runs it for its lifetime (cancelling it stops the loops); the relay
    feeds passive health through `backends.fleet.report_success` / `report_failure`."""
    async with asyncio.TaskGroup() as group:
        group.create_task(run_health(fleet, session, settings, clock), name="backends health")
        group.create_task(run(fleet, session, settings, clock), name="backends scrape")
        group.create_task(run_lora_discovery(fleet, session, settings, clock), name="backends lora discovery")


# engine kinds whose /v1/models lists runtime LoRA adapters with `parent` (the simulator serves it as vLLM does)
LISTING_ENGINES = frozenset({"vllm", "vllm-ascend", "sim"})
LISTED_STATES = frozenset({EndpointState.READY, EndpointState.DRAINING})
MAX_LISTING_BYTES = 4 << 20  # a /v1/models body: MAX_LISTED entries of a few hundred bytes each


def listed_adapters(payload: bytes) -> frozenset[str] | None:
    """The adapter ids of a `/v1/models` answer (entries whose `parent` names another model), or None
    when the answer is not a models list."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:  # orjson refuses nesting past 1024 levels this way too
        return None
    data = parsed.get("data") if isinstance(parsed, dict) else None
    if not isinstance(data, list):
        return None
    names: set[str] = set()
    for entry in data:
        if not isinstance(entry, dict):
            continue
        name, parent = entry.get("id"), entry.get("parent")
        if isinstance(name, str) and isinstance(parent, str) and parent and parent != name:
            if len(name) > MAX_NAME_CHARS:
                continue  # no adapter the gateway declares is named that way; kept, it is unbounded memory
            names.add(name)
            if len(names) >= MAX_LISTED:
                break
    return frozenset(names)


def serving_pools(fleet: Fleet) -> set[str]:
    """The pools that serve the base model of a declared adapter (the only ones worth asking)."""
    bases = {adapter.base_model for adapter in fleet.adapters.values()}
    return {name for name, pool in fleet.pools.items() if pool.config.model in bases}


class LoraDiscovery:
    """One pass per interval: which endpoints to ask now; each answer lands on its `Endpoint`."""

    def __init__(self, settings: BackendsSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._tasks = EndpointTasks("lora discovery")
        self._warned: set[str] = set()

    def candidates(self, fleet: Fleet) -> Iterable[Endpoint]:
        pools = serving_pools(fleet)
        for name in pools:
            for endpoint in fleet.pools[name].endpoints:
                if endpoint.engine in LISTING_ENGINES and endpoint.state in LISTED_STATES:
                    yield endpoint

    async def discover(self, endpoint: Endpoint, session: aiohttp.ClientSession) -> bool:
        """One GET of one endpoint's models; True when `endpoint.loras` was updated."""
        sent_s = self.clock()
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        try:
            async with session.get(endpoint.base_url + "/v1/models", headers=headers, timeout=timeout) as response:
                status = response.status
                body = await read_bounded(response, MAX_LISTING_BYTES) if status == 200 else b""
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("lora discovery %s: %r", endpoint.id, exc)
            return False
        names = listed_adapters(body) if status == 200 and body is not None else None
        if names is None:
            if endpoint.id not in self._warned:
                self._warned.add(endpoint.id)
                log.warning("endpoint %s: /v1/models answered %d without a models list", endpoint.id, status)
            return False
        endpoint.loras = names
        endpoint.loras_at_s = sent_s
        return True

    def tick(self, fleet: Fleet, session: aiohttp.ClientSession) -> None:
        for endpoint in self.candidates(fleet):
            if not self._tasks.busy(endpoint.id):
                self._tasks.start(endpoint.id, self.discover(endpoint, session))

    async def close(self) -> None:
        await self._tasks.close()


async def run_lora_discovery(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    settings: BackendsSettings,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Ask every adapter-serving endpoint for its adapters every `lora_discovery_interval_s` until cancelled."""
    discovery = LoraDiscovery(settings, clock)
    try:
        while True:
            discovery.tick(fleet, session)
            await asyncio.sleep(settings.lora_discovery_interval_s)
    finally:
        await discovery.close()


def endpoint_status(endpoint: Endpoint, now_s: float, stats_max_age_s: float) -> dict[str, Any]:
    age_s = endpoint.stats_age_s(now_s)
    stats = endpoint.stats
    item: dict[str, Any] = {
        "id": endpoint.id,
        "url": endpoint.base_url,
        "engine": endpoint.engine,
        "served_model": endpoint.served_model,
        "role": endpoint.role.value,
        "state": endpoint.state.value,
        "reason": endpoint.state_reason or None,
        "launched": endpoint.launched,
        "restarts": endpoint.restarts,
        "devices": list(endpoint.devices),
        "pid": endpoint.pid,
        # Kept flat for dashboards and the existing admin shape.
        "running": stats.running,
        "waiting": stats.waiting,
        "kv_usage_ratio": round(stats.kv_usage_ratio, 4),
        "stats_age_s": None if age_s == float("inf") else round(age_s, 3),
        "stats_stale": is_stale(endpoint, now_s, stats_max_age_s),
        "prefix_cache_hits_tokens": stats.prefix_cache_hits_tokens,
        "prefix_cache_queries_tokens": stats.prefix_cache_queries_tokens,
        "preemptions": stats.preemptions,
        "block_size": stats.block_size,
        "num_gpu_blocks": stats.num_gpu_blocks,
        "waiting_by_reason": dict(stats.waiting_by_reason),
        "prompt_tokens": stats.prompt_tokens,
        "prompt_tokens_cached": stats.prompt_tokens_cached,
        "sleep_state": stats.sleep_state,
        # LoRA adapters the engine lists in /v1/models (backends/scrape.py); null: not asked
        "loras": sorted(endpoint.loras) if endpoint.loras is not None else None,
        "inflight_requests": endpoint.inflight.requests,
        "inflight_prefill_tokens": endpoint.inflight.prefill_tokens,
        "inflight_decode_tokens": endpoint.inflight.decode_tokens,
        "consecutive_failures": endpoint.consecutive_failures,
        "ejected_for_s": round(max(0.0, endpoint.ejected_until_s - now_s), 3)
        if endpoint.state is EndpointState.UNHEALTHY
        else None,
        "log_path": endpoint.log_path,
    }
    if endpoint.log_tail:
        item["log_tail"] = list(endpoint.log_tail)
    return item


def fleet_status(fleet: Fleet, now_s: float | None = None, stats_max_age_s: float = 2.0) -> dict[str, Any]:
    """JSON-ready snapshot: pools, endpoints, state and reason, load, KV usage, restarts."""
    now_s = time.monotonic() if now_s is None else now_s
    pools = []
    for pool in fleet.pools.values():
        endpoints = [endpoint_status(e, now_s, stats_max_age_s) for e in pool.endpoints]
        states: dict[str, int] = {}
        for e in pool.endpoints:
            states[e.state.value] = states.get(e.state.value, 0) + 1
        pools.append(
            {
                "name": pool.name,
                "model": pool.config.model,
                "engine": pool.config.engine,
                "disaggregated": pool.config.disaggregated,
                "ready": sum(1 for e in pool.endpoints if e.state is EndpointState.READY),
                "total": len(pool.endpoints),
                "states": states,
                "endpoints": endpoints,
            }
        )
    return {"pools": pools}


_COLUMNS = ("endpoint", "state", "run", "wait", "kv", "inflight", "restarts", "stats_age", "url")


def format_status(status: dict[str, Any], show_log_tail: bool = True) -> str:
    """A fixed-width table of `fleet_status` output, reasons and log tails under failed endpoints."""
    lines: list[str] = []
    for pool in status.get("pools", []):
        lines.append(
            f"pool {pool['name']} (model {pool['model']}, engine {pool['engine']}): "
            f"{pool['ready']}/{pool['total']} ready"
        )
        rows = [_COLUMNS]
        notes: dict[int, list[str]] = {}
        for e in pool["endpoints"]:
            age = e.get("stats_age_s")
            rows.append(
                (
                    e["id"],
                    e["state"] + ("*" if e.get("stats_stale") and e["state"] == "ready" else ""),
                    str(e.get("running", 0)),
                    str(e.get("waiting", 0)),
                    f"{100 * (e.get('kv_usage_ratio') or 0.0):.0f}%",
                    str(e.get("inflight_requests", 0)),
                    str(e.get("restarts", 0)),
                    "-" if age is None else f"{age:.1f}s",
                    e.get("url", ""),
                )
            )
            extra = []
            if e.get("reason"):
                extra.append(f"reason: {e['reason']}")
            if show_log_tail and e.get("log_tail"):
                extra.append(f"last log lines ({e.get('log_path')}):")
                extra += [f"  | {line}" for line in e["log_tail"]]
            if extra:
                notes[len(rows) - 1] = extra
        widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
        for n, row in enumerate(rows):
            lines.append("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
            lines += [f"      {note}" for note in notes.get(n, [])]
        lines.append("")
    if any(e.get("stats_stale") and e["state"] == "ready" for p in status.get("pools", []) for e in p["endpoints"]):
        lines.append("* stats stale: routing treats the endpoint as saturated")
    return "\n".join(lines).rstrip() + "\n"

"""The fleet: every pool of the gateway, its endpoints and their health, the LoRA adapters its pools
serve, and the engine adapter of each `engine:` kind (`ADAPTERS`, `get_adapter`).

One module because these are what the request path and the background tasks ask of the fleet:
which pools serve a model or an adapter, which endpoints are in, how each engine kind is spoken to,
and the passive health that every relayed answer reports.

The engine adapters by kind are listed once, in `ADAPTERS` at the end (a new engine is one module in
`backends/adapters/` plus one line there); the keys are the `engine:` values of gateway.yaml
(`backends.config.EngineKind`).

LoRA adapters
-------------
LoRA adapters as the fleet knows them: a name clients ask for, served by the pools of its base model.

The policy declares them (`models:` entries of `kind: adapter`, policies/schema.py); the gateway
hands the fleet this view on every policy (re)load, so the fleet answers "which pools serve it" and
the transport knows what to load (docs/adapters.md).

Pools and endpoints
-------------------
The fleet: every pool of the gateway and its endpoints, alive for the gateway's lifetime.

The gateway reads it (routing candidates, readiness); backends' background tasks keep it current
(launching, health, scraping). It is built from the `pools:` list of gateway.yaml.

Health
------
Endpoint health: passive signals from the relay, active checks on an interval, half-open probes.

Passive: the gateway's relay calls `report_failure` on a connect error or a 5xx and `report_success`
on any other answer. `consecutive_failures` in a row eject a READY endpoint: it becomes UNHEALTHY
until a cooldown ends. Active: `run` probes READY endpoints' health path on an interval (the same
threshold ejects), probes static endpoints that have not answered yet, and, once an ejected
endpoint's cooldown is over, sends one half-open probe that decides: success brings it back to
READY, failure ejects it again with a doubled cooldown (up to a maximum).

Launched replicas in STARTING, DRAINING or DEAD belong to the supervisor; health never touches them.

Overload must not become an outage. An ejection is withheld when it would put more of the pool's
endpoints (of the same role) out than `max_ejection_percent`, or the last one still in (Envoy's
outlier detection caps ejections the same way); one endpoint may always go. A failed health probe
of an endpoint that answered requests or relayed a token within the last few probe intervals does
not count: an engine busy serving is alive, however slowly its health route answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import aiohttp

from backends.adapters.base import EngineAdapter, Probe
from backends.adapters.hosted import ANTHROPIC, AZURE_OPENAI, BEDROCK, GEMINI, OPENAI_REMOTE
from backends.adapters.trtllm import TRTLLM
from backends.adapters.vllm import SIM, VLLM, VLLM_ASCEND
from backends.config import BackendsSettings, EjectionSettings, PoolConfig
from backends.types import GATEWAY_EXHAUSTED, UNKNOWN, Endpoint, EndpointState, Role

MB = 1024 * 1024
DEFAULT_ADAPTER_BYTES = 64 * MB  # an adapter whose size is unknown (a rank-16 adapter of an 8B model is tens of MB)
MAX_SIZED_FILES = 10_000  # files summed for a local adapter's size: a directory is not trusted to be small


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str  # the public name, and the name the engines serve it under (vLLM's lora_name)
    base_model: str  # the public model whose pools serve it
    source: str  # what the engine loads: a local path, or a URI its resolvers understand
    size_bytes: int | None = None  # the predicted load time and a pool's memory budget; None: unknown
    preload: bool = False  # loaded on every ready replica of its base's pools, never unloaded for idleness
    idle_unload_s: float | None = None  # unloaded from a replica where it went unused this long; None: the pool's

    def load_s(self, bandwidth_bytes_s: float, default_bytes: int) -> float:
        """Seconds to bring it onto a GPU at `bandwidth_bytes_s` (`default_bytes` when its size is unknown)."""
        return (self.size_bytes or default_bytes) / bandwidth_bytes_s


def local_size_bytes(source: str) -> int | None:
    """Bytes of a local adapter (a file, or a directory's files) when it is readable here, else None (a
    URI the engine resolves, or a path only the engine's host has). Read when the policy loads, so a
    pool's memory budget counts the adapter as the engine will hold it without a `size_mb` to keep true."""
    if "://" in source or not os.path.isabs(source):
        return None
    try:
        if os.path.isfile(source):
            return os.path.getsize(source)
        if not os.path.isdir(source):
            return None
        total = files = 0
        for root, _dirs, names in os.walk(source):
            for name in names:
                total += os.path.getsize(os.path.join(root, name))
                files += 1
                if files >= MAX_SIZED_FILES:
                    return total
        return total or None
    except OSError:
        return None


def budget_bytes(budget_mb: float | None) -> int | None:
    """A pool's `lora_memory_budget_mb` in bytes (None: no budget, `max_loras` alone bounds a replica)."""
    return int(budget_mb * MB) if budget_mb is not None else None


def too_large(adapter: LoraAdapter, budgets: Iterable[tuple[str, int | None]]) -> str | None:
    """Why `adapter` fits none of the pools (`(pool, budget bytes)`) that would serve it, else None: an
    adapter larger than a replica's whole budget can never be loaded there, whatever is evicted."""
    size = adapter.size_bytes
    listed = list(budgets)
    if size is None or not listed or any(budget is None or size <= budget for _pool, budget in listed):
        return None
    pools = ", ".join(f"{pool} ({budget / MB:g} MB)" for pool, budget in listed if budget is not None)
    return (
        f"The adapter '{adapter.name}' ({size / MB:g} MB) is larger than the LoRA memory budget of every pool "
        f"serving its base model '{adapter.base_model}': {pools} (lora_memory_budget_mb)"
    )


@dataclass(slots=True, eq=False)
class Pool:
    config: PoolConfig
    endpoints: list[Endpoint] = field(default_factory=list)
    disaggregated: bool = field(init=False)  # has prefill/decode roles (fixed by its config)
    # its config's name, kept as a field: the request path reads it a dozen times per request
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.disaggregated = self.config.disaggregated
        self.name = self.config.name

    def ready_endpoints(self, role: Role | None = None) -> list[Endpoint]:
        return [
            e
            for e in self.endpoints
            if e.state is EndpointState.READY and (role is None or e.role is role or e.role is Role.BOTH)
        ]

    def servable(self, exclude: Collection[str] = ()) -> list[Endpoint]:
        """Ready endpoints that can serve a whole request (not prefill-only), minus `exclude`."""
        return [
            e
            for e in self.endpoints
            if e.state is EndpointState.READY and e.role is not Role.PREFILL and e.id not in exclude
        ]

    def serves_besides(self, endpoint: Endpoint, exclude: Collection[str]) -> bool:
        """Whether a `servable` endpoint other than `endpoint` is left (asked on every send: no list built)."""
        for e in self.endpoints:
            if (
                e is not endpoint
                and e.state is EndpointState.READY
                and e.role is not Role.PREFILL
                and e.id not in exclude
            ):
                return True
        return False

    @property
    def has_ready(self) -> bool:
        """Whether the pool can serve: a ready endpoint that decodes (a prefill-only one cannot)."""
        return any(e.state is EndpointState.READY and e.role is not Role.PREFILL for e in self.endpoints)

    @property
    def can_serve(self) -> bool:
        """Whether a request for the pool will be served: a ready endpoint, or an autoscaled pool that
        starts or wakes one on demand (scaled to zero, not failed)."""
        if self.has_ready:
            return True
        return self.config.elastic and any(e.launched and e.state is not EndpointState.DEAD for e in self.endpoints)


def _no_adapters() -> Mapping[str, LoraAdapter]:
    return {}


class Fleet:
    """Pools by name and by public model name."""

    def __init__(self, pools: Iterable[Pool]) -> None:
        self.pools: dict[str, Pool] = {p.name: p for p in pools}
        self._by_model: dict[str, list[Pool]] = {}
        for pool in self.pools.values():
            self._by_model.setdefault(pool.config.model, []).append(pool)
        for listed in self._by_model.values():  # overflow pools are routed to after the owned ones
            listed.sort(key=lambda pool: pool.config.overflow)
        # LoRA adapters by name, read from the live policy (the gateway points this at it): an adapter
        # is served by its base model's pools (docs/adapters.md)
        self._adapters: Callable[[], Mapping[str, LoraAdapter]] = _no_adapters

    def follow_adapters(self, source: Callable[[], Mapping[str, LoraAdapter]]) -> None:
        """Read the adapters from `source` (the current policy's, so a reload changes them at once)."""
        self._adapters = source

    @property
    def adapters(self) -> Mapping[str, LoraAdapter]:
        return self._adapters()

    def adapter(self, model: str) -> LoraAdapter | None:
        """The adapter a public model name denotes, or None for a model of its own."""
        return self._adapters().get(model)

    @classmethod
    def from_configs(cls, configs: Sequence[PoolConfig]) -> Fleet:
        """A fleet of the pools' static endpoints; launched replicas are added by the supervisor."""
        pools = []
        for cfg in configs:
            pool = Pool(cfg)
            for i, static in enumerate(cfg.endpoints):
                pool.endpoints.append(
                    Endpoint(
                        id=f"{cfg.name}/{static.role.value}-s{i}",
                        pool=cfg.name,
                        base_url=static.url,
                        engine=cfg.engine,
                        served_model=cfg.upstream_model,
                        role=static.role,
                        api_key=static.api_key or cfg.api_key,
                        max_model_len=cfg.max_model_len,
                        kv_events_endpoint=static.kv_events_endpoint,
                        kv_events_replay_endpoint=static.kv_events_replay_endpoint,
                        topology=static.topology.labels() if static.topology is not None else UNKNOWN,
                    )
                )
            pools.append(pool)
        return cls(pools)

    def pools_for_model(self, model: str) -> list[Pool]:
        pools = self._by_model.get(model)
        if pools is None:
            adapter = self._adapters().get(model)
            if adapter is not None:  # an adapter runs on its base model's pools
                return self._by_model.get(adapter.base_model, [])
        return pools or []

    @property
    def models(self) -> list[str]:
        return list(self._by_model)

    def endpoints(self) -> Iterable[Endpoint]:
        for pool in self.pools.values():
            yield from pool.endpoints

    def endpoint(self, endpoint_id: str) -> Endpoint | None:
        for e in self.endpoints():
            if e.id == endpoint_id:
                return e
        return None


log = logging.getLogger(__name__)

DEFAULT_EJECTION = EjectionSettings()


class EndpointTasks:
    """At most one background task per endpoint: the shape shared by health probes and metrics
    scrapes. Each probe or scrape runs as its own task so a slow endpoint delays no other; an
    endpoint whose previous task is still running is skipped rather than piled onto."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._running: dict[str, asyncio.Task[Any]] = {}

    def busy(self, endpoint_id: str) -> bool:
        return endpoint_id in self._running

    def start(self, endpoint_id: str, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work, name=f"{self.kind} {endpoint_id}")
        self._running[endpoint_id] = task
        task.add_done_callback(lambda _task: self._running.pop(endpoint_id, None))

    async def close(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def report_success(endpoint: Endpoint, now_s: float | None = None) -> None:
    """An upstream answer that was not a server error: the failure streak ends."""
    endpoint.consecutive_failures = 0
    endpoint.answered_at_s = time.monotonic() if now_s is None else now_s


def report_failure(
    endpoint: Endpoint, now_s: float, ejection: EjectionSettings = DEFAULT_EJECTION, pool: Pool | None = None
) -> bool:
    """A connect error or 5xx from the endpoint. Returns True when this failure ejected it
    (`pool`, when given, caps ejections: see the module docstring)."""
    endpoint.consecutive_failures += 1
    if endpoint.state is EndpointState.READY and endpoint.consecutive_failures >= ejection.consecutive_failures:
        return eject_capped(endpoint, pool, now_s, ejection, f"{endpoint.consecutive_failures} consecutive failures")
    return False


def may_eject(endpoint: Endpoint, pool: Pool | None, ejection: EjectionSettings) -> bool:
    """Whether ejecting this READY endpoint keeps its pool within `max_ejection_percent`: among the
    endpoints of its role that health manages (ready or ejected), at most that share out (at least one
    may go), and never the last one in."""
    if pool is None:
        return True
    peers = [
        e
        for e in pool.endpoints
        if e.role is endpoint.role and e.state in (EndpointState.READY, EndpointState.UNHEALTHY)
    ]
    ready = sum(1 for e in peers if e.state is EndpointState.READY)
    if ready <= 1:
        return False
    ejected = len(peers) - ready
    allowed = max(1, int(len(peers) * ejection.max_ejection_percent / 100.0))
    return ejected + 1 <= allowed


def eject_capped(endpoint: Endpoint, pool: Pool | None, now_s: float, ejection: EjectionSettings, why: str) -> bool:
    """Eject unless the cap says no; True when ejected. A withheld ejection is logged once."""
    if may_eject(endpoint, pool, ejection):
        eject(endpoint, now_s, ejection, why)
        return True
    reason = f"ejection withheld ({why}): max_ejection_percent {ejection.max_ejection_percent:g} of the pool"
    if endpoint.state_reason != reason:
        log.warning("endpoint %s not ejected (%s): the pool keeps it serving", endpoint.id, why)
        endpoint.state_reason = reason
    return False


def recently_serving(endpoint: Endpoint, now_s: float, window_s: float) -> bool:
    """An answer or a relayed token from the endpoint within `window_s` (monotonic clock)."""
    last_s = max(endpoint.answered_at_s, endpoint.inflight.last_token_s)
    return last_s > 0.0 and 0.0 <= now_s - last_s <= window_s


def eject(endpoint: Endpoint, now_s: float, ejection: EjectionSettings, why: str) -> None:
    """UNHEALTHY for a cooldown that doubles with each ejection that was not followed by recovery."""
    cooldown_s = min(ejection.cooldown_s * 2**endpoint.ejections, ejection.max_cooldown_s)
    endpoint.ejections += 1
    endpoint.state = EndpointState.UNHEALTHY
    endpoint.ejected_until_s = now_s + cooldown_s
    endpoint.state_reason = f"ejected: {why}; half-open probe in {cooldown_s:g}s"
    log.warning("endpoint %s ejected for %.1fs: %s", endpoint.id, cooldown_s, why)


def recover(endpoint: Endpoint) -> None:
    """A successful probe: READY again, streaks and cooldowns reset."""
    if endpoint.state is not EndpointState.READY:
        log.info("endpoint %s is ready", endpoint.id)
    endpoint.state = EndpointState.READY
    endpoint.consecutive_failures = 0
    endpoint.ejections = 0
    endpoint.ejected_until_s = 0.0
    endpoint.state_reason = ""


def half_open_due(endpoint: Endpoint, now_s: float) -> bool:
    return endpoint.state is EndpointState.UNHEALTHY and now_s >= endpoint.ejected_until_s


async def probe(endpoint: Endpoint, session: aiohttp.ClientSession, timeout_s: float) -> Probe | None:
    """One GET of the endpoint's health path, interpreted by its engine's adapter; None when the
    gateway itself could not open the connection (out of file descriptors): that says nothing of the
    engine, and ejecting healthy engines would turn a short shortage into an outage."""
    adapter = get_adapter(endpoint.engine)
    if not adapter.health_path:  # a hosted API: not probed (backends/adapters/hosted.py), passive ejection only
        return adapter.classify_health(200, {})
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    try:
        async with session.get(
            endpoint.base_url + adapter.health_path,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            await response.read()
            return adapter.classify_health(response.status, response.headers)
    except aiohttp.ClientConnectorError as exc:
        if exc.os_error.errno in GATEWAY_EXHAUSTED:
            return None
        return adapter.classify_health(None, {})
    except (TimeoutError, aiohttp.ClientConnectionError):
        return adapter.classify_health(None, {})
    except aiohttp.ClientError:
        return Probe.FAILING
    except OSError as exc:  # raised by the socket call itself, not wrapped by aiohttp
        if exc.errno in GATEWAY_EXHAUSTED:
            return None
        raise


class HealthChecker:
    """The active side: one pass decides which endpoints to probe now and applies the outcomes."""

    def __init__(self, settings: BackendsSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._last_probe_s: dict[str, float] = {}
        self._active_failures: dict[str, int] = {}  # kept apart from the relay's passive streak
        self._tasks = EndpointTasks("health")

    def due(self, endpoint: Endpoint, now_s: float) -> bool:
        if self._tasks.busy(endpoint.id):
            return False
        if endpoint.state is EndpointState.UNHEALTHY:
            return half_open_due(endpoint, now_s)
        if endpoint.launched and endpoint.state is not EndpointState.READY:
            return False  # the supervisor watches starting, draining and dead replicas
        if endpoint.state not in (EndpointState.READY, EndpointState.STARTING):
            return False
        remote = not get_adapter(endpoint.engine).launches
        interval_s = self.settings.remote_health_interval_s if remote else self.settings.health_interval_s
        if endpoint.state is EndpointState.STARTING:
            interval_s = min(interval_s, self.settings.health_interval_s)  # static, not yet answered
        return now_s - self._last_probe_s.get(endpoint.id, float("-inf")) >= interval_s

    async def check(self, endpoint: Endpoint, session: aiohttp.ClientSession, pool: Pool | None = None) -> None:
        self._last_probe_s[endpoint.id] = self.clock()
        verdict = await probe(endpoint, session, self.settings.health_timeout_s)
        if verdict is not None:  # None: the gateway could not ask (its own shortage), no verdict
            self.apply(endpoint, verdict, self.clock(), pool)

    @property
    def alive_window_s(self) -> float:
        """How recently an endpoint must have served for a failed probe not to count: the span over
        which failed probes would eject it."""
        settings = self.settings
        return max(settings.health_interval_s, settings.health_timeout_s) * settings.ejection.consecutive_failures

    def apply(self, endpoint: Endpoint, verdict: Probe, now_s: float, pool: Pool | None = None) -> None:
        ejection = self.settings.ejection
        if endpoint.launched and endpoint.state not in (EndpointState.READY, EndpointState.UNHEALTHY):
            return  # the supervisor moved it on (restart, drain) while the probe was in flight
        if verdict is Probe.READY:
            self._active_failures[endpoint.id] = 0
            if endpoint.state in (EndpointState.UNHEALTHY, EndpointState.STARTING):
                recover(endpoint)
            return
        if endpoint.state is EndpointState.UNHEALTHY:
            eject(endpoint, now_s, ejection, f"half-open probe failed ({verdict.value})")
        elif endpoint.state is EndpointState.STARTING:
            if verdict is Probe.FAILING:
                eject(endpoint, now_s, ejection, "not answering its health check")
        elif endpoint.state is EndpointState.READY:
            if recently_serving(endpoint, now_s, self.alive_window_s):
                self._active_failures[endpoint.id] = 0  # busy, not dead: it is answering requests
                return
            count = self._active_failures.get(endpoint.id, 0) + 1
            self._active_failures[endpoint.id] = count
            if count >= ejection.consecutive_failures:
                self._active_failures[endpoint.id] = 0
                eject_capped(endpoint, pool, now_s, ejection, f"{count} failed health checks")

    def tick(self, fleet: Fleet, session: aiohttp.ClientSession) -> None:
        """Start the probes that are due; each runs as its own task so a slow one delays no other."""
        now_s = self.clock()
        for pool in fleet.pools.values():
            for endpoint in pool.endpoints:
                if self.due(endpoint, now_s):
                    self._tasks.start(endpoint.id, self.check(endpoint, session, pool))

    async def close(self) -> None:
        await self._tasks.close()


async def run(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    settings: BackendsSettings,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Active health checks until cancelled."""
    checker = HealthChecker(settings, clock)
    tick_s = min(settings.health_interval_s, settings.ejection.cooldown_s, 0.5)
    try:
        while True:
            checker.tick(fleet, session)
            await asyncio.sleep(tick_s)
    finally:
        await checker.close()


ADAPTERS: Mapping[str, EngineAdapter] = MappingProxyType({
    "vllm": VLLM,
    "trtllm": TRTLLM,
    "vllm-ascend": VLLM_ASCEND,
    "openai": OPENAI_REMOTE,
    "anthropic": ANTHROPIC,
    "bedrock": BEDROCK,
    "gemini": GEMINI,
    "azure-openai": AZURE_OPENAI,
    "sim": SIM,
})  # fmt: skip


def get_adapter(kind: str) -> EngineAdapter:
    """The adapter of an engine kind; KeyError names the known kinds."""
    try:
        return ADAPTERS[kind]
    except KeyError:
        raise KeyError(f"unknown engine kind {kind!r}; known: {', '.join(sorted(ADAPTERS))}") from None

"""The app factory: builds every long-lived object in `cleanup_ctx` generators (set up before the
yield, torn down after, in reverse order) and stores them under typed AppKeys, behind the middleware
chain every route shares. Nothing here runs at import time, so tests can build several apps in one
process.

## The middleware chain

`not_found_middleware` turns aiohttp's plain-text 404 / 405 into OpenAI's error shape with an
`x-request-id` (Anthropic's under /v1/messages), and a body that cannot be read (not the
`Content-Encoding` it claims) into a 400 on every route, whichever handler read it.
`canonical_path_middleware` answers 400 to any path whose raw form is not the one canonical form (dot
segments, empty segments, backslashes, percent-encoded dots or slashes), on every route: a route sees
an id only as the client wrote it, never as a normaliser rewrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from backends import scrape
from backends.discovery.service import Discovery
from backends.fleet import Fleet, get_adapter, report_success
from backends.fleet import report_failure as health_report_failure
from backends.kv_events import KvEventHub
from backends.supervisor import Supervisor
from backends.tokenization import encoding
from backends.types import Endpoint
from gateway import __version__
from gateway.apis.messages import anthropic_error, error_in_route_shape
from gateway.apis.routes import RESPONSE_STORE, setup_api_routes
from gateway.apis.store import make_response_store
from gateway.app import keys as appkeys
from gateway.app.checks import config_findings, errors
from gateway.app.policy_reload import PolicyWatcher
from gateway.app.settings import GatewaySettings, StateSettings
from gateway.audit.api import audit_ctx, audit_routes
from gateway.autoscale.wiring import AUTOSCALER, ELASTIC_HOOK, autoscale_ctx
from gateway.batch.routes import setup_batch_routes
from gateway.batch.setup import batch_ctx, batch_gate
from gateway.console.activity import ConsoleActivity
from gateway.console.adapters import LORA_LOADER
from gateway.console.routes import console_admin_routes, console_routes
from gateway.console.sessions import ConsoleSessions
from gateway.console.shared import SharedActivity
from gateway.console.tenant_spend import TenantSpend
from gateway.errors import GatewayError, InvalidRequest, error_response
from gateway.flow.checks import Saturation, SloHook, Spill
from gateway.flow.gate import Check, Gate
from gateway.flow.queue import FlowQueue
from gateway.http.admin import admin_routes, key_routes, limiter_gauges, override_routes, own_key, predictor_gauges
from gateway.http.bodies import body_bounds, bounded_bodies
from gateway.http.openapi import setup_openapi_route
from gateway.http.outcome import setup_outcome_routes
from gateway.http.routes import METRICS_RENDER, METRICS_TOKEN, setup_routes
from gateway.ledger import open_ledger
from gateway.ledger.reconcile import reconcile_ctx
from gateway.replicas.bus import ReplicaBus, default_replica_id
from gateway.request import Director, Hook, Hooks
from gateway.request.accounting import Accounting
from gateway.request.director import Dispatch
from gateway.request.intake import Intake
from gateway.request.intake import request_id as request_id_of
from gateway.telemetry.metrics import FlowMetrics, GatewayMetrics
from gateway.telemetry.tracing import Tracing
from gateway.transport.engine import EngineTransport
from gateway.transport.hosted import HostedCalls, HostedTransport, PoolTransports
from gateway.transport.lora import keeping
from gateway.transport.lora_shared import SharedAdapters, sharing
from gateway.transport.observers import LearningHook, RouteMetrics, ToolBoundary
from gateway.transport.provider_quota import ProviderQuotaCheck, ProviderQuotas
from gateway.upstream.client import UpstreamClient
from gateway.upstream.engine_tokens import EngineTokenizer, build_counters
from gateway.upstream.replica_loss import StallWatch, watching
from policies.estimate import PromptEstimator
from policies.flow.order import Counters, MemoryCounters, MemoryPrograms, ProgramService, band_name
from policies.flow.redis_counters import RedisCounters, RedisPrograms
from policies.holder import PolicyHolder, ReloadResult
from policies.keys.directory import KeyDirectory
from policies.keys.store import (
    DirectoryStore,
    MemoryDirectoryStore,
    MirroredDirectoryStore,
    RedisDirectoryStore,
    SqliteDirectoryStore,
)
from policies.limits.admission import Admission
from policies.limits.failover import make_store
from policies.policy import Policy
from policies.routing.pipeline import build_router
from predictor.service import LatencyPredictor

log = logging.getLogger("tokenway.app")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RouteNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "unknown_url"


class NonCanonicalPath(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_path"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


@web.middleware
async def not_found_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404 / 405 answers, in the API's error shape."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        error: GatewayError = RouteNotFound(f"Unknown request URL: {request.method} {request.path}.")
    except web.HTTPMethodNotAllowed as exc:
        error = MethodNotAllowed(
            f"{request.method} is not allowed on {request.path} (allowed: {', '.join(sorted(exc.allowed_methods))})."
        )
        error.headers.append(("Allow", ", ".join(sorted(exc.allowed_methods))))
    except RequestPayloadError as exc:  # the client's body, not the gateway: 400
        error = InvalidRequest(f"the request body could not be read: {str(exc).strip()}")
    request_id = request_id_of(request.headers)
    if request.path.startswith("/v1/messages"):
        return anthropic_error(error, [("x-request-id", request_id)], request_id)
    return error_response(error, [("x-request-id", request_id)])


# Percent-encoded bytes a canonical path never holds: an unreserved dot (RFC 3986 keeps those
# unencoded), slashes and backslashes (a path's structure is its raw slashes), NUL.
_ENCODED = ("%2e", "%2f", "%5c", "%00")
# Model names may hold a slash ("org/model"): that route takes it percent-encoded.
_SLASHED_IDS = "/v1/models/"


def path_problem(raw_path: str) -> str | None:
    """Why the raw request target's path is not canonical, or None when it is."""
    path = raw_path.partition("?")[0].partition("#")[0]
    if not path.startswith("/"):
        return "the request path must be absolute"
    if "//" in path:
        return "the request path holds an empty segment ('//')"
    if "\\" in path:
        return "the request path holds a backslash"
    if "/." in path and any(segment in (".", "..") for segment in path.split("/")):
        return "the request path holds a '.' or '..' segment"
    if "%" in path:
        lowered = path.lower()
        for encoded in _ENCODED:
            if encoded in lowered:
                if encoded in ("%2f", "%5c") and lowered.startswith(_SLASHED_IDS) and lowered.count("/") == 3:
                    continue
                return f"the request path holds a percent-encoded {encoded!r}"
    return None


@web.middleware
async def canonical_path_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A 400 for a path that is not in its canonical form, before any route (or normaliser) sees it."""
    raw = request.raw_path
    if "//" not in raw and "\\" not in raw and "/." not in raw and "%" not in raw:
        return await handler(request)  # the common case: nothing to look at
    problem = path_problem(raw)
    if problem is None:
        return await handler(request)
    error = NonCanonicalPath(f"{problem}: send each path in its one canonical form.")
    request_id = request_id_of(request.headers)
    if request.path.startswith("/v1/messages"):
        return anthropic_error(error, [("x-request-id", request_id)], request_id)
    return error_response(error, [("x-request-id", request_id)])


def create_app(settings: GatewaySettings) -> web.Application:
    app = web.Application(
        client_max_size=settings.server.max_body_bytes,
        # the first is the outermost; every body is read under one set of bounds (gateway/http/bodies.py)
        middlewares=[
            canonical_path_middleware,
            not_found_middleware,
            bounded_bodies(body_bounds(settings.server), render=error_in_route_shape),
        ],
    )
    app[appkeys.SETTINGS] = settings
    app[appkeys.BACKENDS] = settings.backends
    app[appkeys.ROUTING_CONFIG] = settings.routing
    app.cleanup_ctx.append(_telemetry_ctx)
    app.cleanup_ctx.append(audit_ctx)  # admin changes, fsync'd one by one (gateway/audit)
    app.cleanup_ctx.append(_session_ctx)
    app.cleanup_ctx.append(_policies_ctx)
    app.cleanup_ctx.append(reconcile_ctx)  # enforced spend vs the ledger, per key (gateway/ledger/reconcile.py)
    app.cleanup_ctx.append(_fleet_ctx)
    app.cleanup_ctx.append(autoscale_ctx)  # elastic pools: the planner, its executor, the cold-start hold
    app.cleanup_ctx.append(_predictor_ctx)
    app.cleanup_ctx.append(_routing_ctx)
    app.cleanup_ctx.append(_replicas_ctx)
    app.cleanup_ctx.append(_flow_ctx)
    app.cleanup_ctx.append(_director_ctx)
    app.cleanup_ctx.append(_shared_activity_ctx)  # the console's overview and tail of every replica
    app.cleanup_ctx.append(_response_store_ctx)
    app.cleanup_ctx.append(batch_ctx)  # files, batches and the runner (after the walk it runs lines on)
    setup_routes(app, admin_routes() + key_routes() + override_routes() + console_admin_routes() + audit_routes())
    app.router.add_get("/v1/key", own_key)
    app.router.add_get("/key/info", own_key)  # LiteLLM's name for the same question
    setup_outcome_routes(app)  # POST /v1/programs/{id}/outcome: cost per outcome (gateway/http/outcome.py)
    for method, path, handler in console_routes():
        app.router.add_route(method, path, handler)
    app[appkeys.CONSOLE_SESSIONS] = ConsoleSessions()
    setup_api_routes(app)
    setup_batch_routes(app)
    setup_openapi_route(app)  # GET /openapi.json: every route above, checked by tests/gateway/test_openapi.py
    if settings.state.shares_routing:
        app.on_response_prepare.append(_name_replica)
    return app


async def _telemetry_ctx(app: web.Application) -> AsyncIterator[None]:
    """Metrics, traces and the usage ledger: set up first, torn down last (after the drain)."""
    settings = app[appkeys.SETTINGS]
    telemetry = settings.telemetry
    # the stream every replica's records meet in: `ledger.redis_stream`, or the state's Redis by default
    ledger_config = settings.ledger.model_copy(update={"redis_stream": settings.ledger.stream(settings.state)})
    metrics = GatewayMetrics(telemetry.metrics, version=__version__)
    app[appkeys.FLOW_METRICS] = FlowMetrics(metrics)  # before the OTLP export reads the families
    tracing = Tracing(telemetry.otlp, metrics=metrics, version=__version__)
    ledger = open_ledger(ledger_config)
    app[appkeys.METRICS] = metrics
    app[appkeys.TRACING] = tracing
    app[appkeys.LEDGER] = ledger
    app[appkeys.TENANT_SPEND] = (
        TenantSpend(ledger_config.dir, ledger_config.redis_stream) if ledger_config.enabled else None
    )
    app[METRICS_RENDER] = metrics.render if telemetry.metrics.enabled else (lambda: b"")
    app[METRICS_TOKEN] = telemetry.metrics.token or None
    if ledger is not None:
        metrics.set_ledger_stats(ledger.stats)
    yield
    if ledger is not None:
        await ledger.close()
    await tracing.shutdown()


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    """The upstream client every relayed request goes through (pooled keep-alive connections to the
    engines), and an aiohttp session for the gateway's own side calls (engine tokenizers)."""
    server = app[appkeys.SETTINGS].server
    upstream = UpstreamClient(
        connect_timeout_s=server.upstream_connect_timeout_s,
        read_timeout_s=server.upstream_read_timeout_s,
        idle_timeout_s=server.upstream_idle_timeout_s,
    )
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    app[appkeys.UPSTREAM], app[appkeys.SESSION] = upstream, session
    yield
    await upstream.close()
    await session.close()


async def _policies_ctx(app: web.Application) -> AsyncIterator[None]:
    """The hot-reloaded policy (file watch + SIGHUP + POST /admin/reload), the directory of keys made
    through the admin API, and the admission store."""
    settings = app[appkeys.SETTINGS]
    directory = KeyDirectory(directory_store(settings.state))
    await directory.start()
    try:
        holder = PolicyHolder.from_file(
            settings.resolve_path(settings.policies), check=_cross_check(settings), directory=directory
        )
    except Exception:
        await directory.stop()
        raise
    app[appkeys.POLICIES] = holder
    app[appkeys.DIRECTORY] = directory
    state = settings.state
    store = make_store(
        state.redis_url if state.backend == "redis" else None, prefix=state.key_prefix, timeout_s=state.redis_timeout_s
    )
    admission = Admission(holder, store)
    app[appkeys.ADMISSION] = admission

    def reloaded(result: ReloadResult) -> None:
        if result.ok and result.changed and appkeys.FLEET in app:
            _allow_labels(app[appkeys.METRICS], holder.current, app[appkeys.FLEET])

    watcher = PolicyWatcher(holder, None, 1.0, reloaded)
    app[appkeys.POLICY_WATCHER] = watcher
    watcher.start()
    app[appkeys.METRICS].set_limiter_gauges(lambda: limiter_gauges(admission.snapshot()))

    def directory_changed() -> None:
        if appkeys.FLEET in app:
            _allow_labels(app[appkeys.METRICS], holder.current, app[appkeys.FLEET])

    directory.on_change(directory_changed)
    yield
    await watcher.stop()
    await admission.close()
    await directory.stop()


def directory_store(state: StateSettings) -> DirectoryStore:
    """Where keys made through the admin API live: Redis with `state: redis` (with the SQLite file as
    its durable copy, restored into a Redis that lost them: policies/keys/store.py), else the file."""
    if state.backend == "redis" and state.redis_url:
        shared = RedisDirectoryStore.from_url(state.redis_url, prefix=state.key_prefix)
        return MirroredDirectoryStore.beside(shared, state.keys_db) if state.keys_db else shared
    if state.keys_db:
        return SqliteDirectoryStore(state.keys_db)
    return MemoryDirectoryStore()


def _cross_check(settings: GatewaySettings) -> Callable[[Policy], list[str]]:
    """At start-up and on every reload: what breaks between gateway.yaml and the policy. Errors
    refuse the policy (a start-up error stops the gateway); warnings are logged."""

    def check(policy: Policy) -> list[str]:
        found = config_findings(settings, policy.config, policy.source)
        for finding in found:
            if finding.severity == "warning":
                log.warning("%s", finding)
        return [str(f) for f in errors(found)]

    return check


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    """Pools: static endpoints, launched replicas (supervised), and the health/metrics watch."""
    settings = app[appkeys.SETTINGS]
    backends = app[appkeys.BACKENDS]
    fleet = Fleet.from_configs(settings.pools)
    policies = app[appkeys.POLICIES]
    fleet.follow_adapters(lambda: policies.current.adapters)  # LoRA adapters: the live policy's (docs/adapters.md)
    app[appkeys.FLEET] = fleet
    supervisor = Supervisor(backends)
    app[appkeys.SUPERVISOR] = supervisor
    await supervisor.start(fleet, app[appkeys.SESSION])
    discovery: Discovery | None = None
    if any(pool.config.discovery is not None for pool in fleet.pools.values()):
        discovery = Discovery.for_fleet(fleet, lambda pool: _fleet_changed(app))
        await discovery.start()
    app[appkeys.DISCOVERY] = discovery
    watch = asyncio.get_running_loop().create_task(scrape.watch(fleet, app[appkeys.SESSION], backends))
    yield
    watch.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watch
    if discovery is not None:
        await discovery.stop()
    await supervisor.stop()


def _fleet_changed(app: web.Application) -> None:
    """Discovery added or removed endpoints: forget routing state of those that left, and let the
    new ones' ids be metric label values."""
    fleet = app[appkeys.FLEET]
    if appkeys.ROUTER in app:
        app[appkeys.ROUTER].forget_endpoints_except([e.id for e in fleet.endpoints()])
    _allow_labels(app[appkeys.METRICS], app[appkeys.POLICIES].current, fleet)


async def _predictor_ctx(app: web.Application) -> AsyncIterator[None]:
    """Latency predictor: loads saved models, trains in its worker, saves on the way out."""
    settings = app[appkeys.SETTINGS].predictor
    predictor: LatencyPredictor | None = None
    if settings.enabled:
        pools = {name: pool.config for name, pool in app[appkeys.FLEET].pools.items()}
        predictor = LatencyPredictor(settings, pools)
        await predictor.start()
        app[appkeys.METRICS].set_predictor_gauges(lambda: predictor_gauges(predictor.status()))
    app[appkeys.PREDICTOR] = predictor
    yield
    if predictor is not None:
        await predictor.stop()


async def _routing_ctx(app: web.Application) -> AsyncIterator[None]:
    """The router of every pool and, in precise mode, the KV-event subscriptions that feed it."""
    config = app[appkeys.ROUTING_CONFIG]
    fleet = app[appkeys.FLEET]
    router = build_router(config, predictor=app[appkeys.PREDICTOR])  # the latency scorer predicts through it
    app[appkeys.ROUTER] = router
    sync: asyncio.Task[None] | None = None
    hub: KvEventHub | None = None
    if config.prefix_index.mode == "precise":
        hub = KvEventHub(router.on_kv_batch, router.on_kv_reset)
        sync = asyncio.get_running_loop().create_task(_sync_kv_events(fleet, router, hub))
    app[appkeys.KV_HUB] = hub
    yield
    if sync is not None:
        sync.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sync
    if hub is not None:
        await hub.close()


async def _replicas_ctx(app: web.Application) -> AsyncIterator[None]:
    """Replicas that act as one (`state: redis`): publish this one's dispatches and load, fold in
    the others' (gateway/replicas). Responses name the replica that served them."""
    state = app[appkeys.SETTINGS].state
    bus: ReplicaBus | None = None
    if state.shares_routing:
        assert state.redis_url is not None
        bus = ReplicaBus(state.replicas, state.redis_url, state.key_prefix, app[appkeys.FLEET], app[appkeys.ROUTER])
        app[appkeys.ROUTER].dispatch_listener = bus.dispatched
        app[appkeys.ROUTER].tool_share = bus  # tool-boundary affinity's notes and returns ride the bus too
        await bus.start()
    app[appkeys.REPLICAS] = bus
    yield
    if bus is not None:
        app[appkeys.ROUTER].dispatch_listener = None
        app[appkeys.ROUTER].tool_share = None
        await bus.stop()


async def _shared_activity_ctx(app: web.Application) -> AsyncIterator[None]:
    """With shared state, publish this process's console activity and read every replica's
    (gateway/console/shared.py); without it, the console shows this process alone."""
    state = app[appkeys.SETTINGS].state
    shared: SharedActivity | None = None
    if state.backend == "redis" and state.redis_url is not None:
        bus = app[appkeys.REPLICAS]
        name = bus.replica_id if bus is not None else default_replica_id()
        shared = SharedActivity(app[appkeys.CONSOLE_ACTIVITY], state.redis_url, state.key_prefix, name)
        await shared.start()
    app[appkeys.SHARED_ACTIVITY] = shared
    yield
    if shared is not None:
        await shared.stop()


async def _name_replica(request: web.Request, response: web.StreamResponse) -> None:
    bus = request.app[appkeys.REPLICAS]
    if bus is not None:
        response.headers["x-tokenway-replica"] = bus.replica_id


async def _sync_kv_events(fleet: Fleet, router: Any, hub: KvEventHub, interval_s: float = 1.0) -> None:
    """Keep one subscription per endpoint that publishes KV events, in step with the fleet."""
    while True:
        ids = []
        for endpoint in fleet.endpoints():
            ids.append(endpoint.id)
            if endpoint.kv_events_endpoint:
                topic = fleet.pools[endpoint.pool].config.kv_events.topic
                hub.ensure(
                    endpoint.id,
                    endpoint.kv_events_endpoint,
                    topic=topic,
                    replay_address=endpoint.kv_events_replay_endpoint,
                )
        router.forget_endpoints_except(ids)
        await asyncio.sleep(interval_s)


async def _flow_ctx(app: web.Application) -> AsyncIterator[None]:
    """Flow control's waiting rooms and the virtual counters they order by (memory, or Redis when
    `state` says so: replicas then share one fairness view)."""
    settings = app[appkeys.SETTINGS]
    flow = settings.flow_control
    state = settings.state
    counters: Counters = MemoryCounters()
    programs: ProgramService = MemoryPrograms()  # program-fair queueing's attained service (docs/agents.md)
    if state.backend == "redis" and state.redis_url:
        counters = RedisCounters.from_url(
            state.redis_url,
            prefix=state.key_prefix,
            refresh_s=flow.advanced.counters_refresh_ms / 1000.0,
            flush_s=flow.advanced.counters_flush_ms / 1000.0,
        )
        programs = RedisPrograms.from_url(
            state.redis_url,
            prefix=state.key_prefix,
            refresh_s=flow.advanced.counters_refresh_ms / 1000.0,
            flush_s=flow.advanced.counters_flush_ms / 1000.0,
        )
    holder = app[appkeys.POLICIES]
    flow_metrics = app[appkeys.FLOW_METRICS]
    queue = FlowQueue(
        counters,
        room_size=flow.room,
        shortest_job_first=lambda: holder.current.config.flow_control.shortest_job_first,
        fair=lambda: holder.current.config.flow_control.fairness == "vtc",
        weights=lambda tenant: holder.current.tenant_weight(tenant),
        recheck_s=flow.advanced.recheck_ms / 1000.0,
        share_window_s=flow.share_window_s,
        active_s=flow.reserve_active_s,
        # with metrics off nothing renders the waits: not observed at all (a histogram child per request)
        on_wait=(
            (lambda pool, band, tenant, s: flow_metrics.observe_wait(pool, band_name(band), tenant, s))
            if settings.telemetry.metrics.enabled
            else None
        ),
        programs=programs,
        program_half_life=lambda tenant: holder.current.program_half_life(tenant),
        program_active_s=flow.program_active_s,
    )
    flow_metrics.set_status(queue.status)
    bus = app[appkeys.REPLICAS]
    if bus is not None:  # the slot reserves judge from every replica's tenants and programs, not this one's alone
        bus.activity = queue.activity
        # program counts go out beside the load report only where a program reserve reads them
        bus.programs = queue.program_activity if flow.program_reserve_on() else None
    app[appkeys.FLOW_SETTINGS] = flow
    app[appkeys.FLOW] = queue
    yield
    if bus is not None:
        bus.activity = None
        bus.programs = None
    await counters.close()
    await programs.close()


async def _director_ctx(app: web.Application) -> AsyncIterator[None]:
    """The walk of a request and the hooks plugged into it (the features: one line each)."""
    settings = app[appkeys.SETTINGS]
    fleet = app[appkeys.FLEET]
    ejection = app[appkeys.BACKENDS].ejection
    predictor = app[appkeys.PREDICTOR]

    def shape_body(endpoint: Endpoint, body: dict[str, Any], api: Any) -> dict[str, Any]:
        return get_adapter(endpoint.engine).shape_request(body, api, fleet.pools[endpoint.pool].config)

    def report_failure(endpoint: Endpoint, now_s: float) -> None:
        health_report_failure(endpoint, now_s, ejection, fleet.pools.get(endpoint.pool))

    metrics = app[appkeys.METRICS]
    metrics_on = settings.telemetry.metrics.enabled
    holder = app[appkeys.POLICIES]
    activity = app[appkeys.CONSOLE_ACTIVITY] = ConsoleActivity(lambda: holder.current)
    ledger = app[appkeys.LEDGER]
    metrics.set_endpoint_gauges(fleet.endpoints)
    _allow_labels(metrics, app[appkeys.POLICIES].current, fleet)
    estimator = PromptEstimator()
    encoding()  # the shared vocabulary read now: a first request that fails to read it would answer 500
    build_counters(fleet, estimator, app[appkeys.UPSTREAM])  # reads tokenizer files once, at start-up
    hook_list: list[Hook] = []
    hook_list.append(app[ELASTIC_HOOK])  # elastic pools: demand counted, streams moved
    if app[appkeys.ROUTING_CONFIG].prefix_index.mode == "precise":
        hook_list.append(EngineTokenizer(app[appkeys.UPSTREAM], fleet))  # real engines' own token ids
    queue = app[appkeys.FLOW]
    cold = app[ELASTIC_HOOK].cold  # a request for a pool at zero waits in the room while it starts
    cold.room = queue
    batch = batch_gate(app, fleet, queue.interactive_depth, predictor)  # batch lines only on spare capacity
    saturation = Saturation(queue, app[appkeys.FLOW_SETTINGS])  # flow control: free slots, the reserve, cuts
    slo = SloHook(predictor=predictor, waiting=queue.waiting_with)  # latency objectives, running TPOT SLOs
    spill = Spill(queue, app[appkeys.POLICIES], fleet)  # owned pools first, overflow pools for the rest
    # the gate: every wait in one room (band / fair-share order), its checks asked in this order
    hosted = {name: pool for name, pool in fleet.pools.items() if pool.config.hosted}
    quotas = app[appkeys.PROVIDER_QUOTAS] = ProviderQuotas()  # hosted providers' own limits, learnt from answers
    quota = [ProviderQuotaCheck(quotas, hosted)] if hosted else []
    checks: list[Check] = [spill, *quota, cold, *([batch] if batch is not None else []), saturation, slo]
    gate = Gate(queue, app[appkeys.FLOW_SETTINGS], app[appkeys.POLICIES], predictor, checks=checks)
    hook_list.extend(check for check in checks if isinstance(check, Hook))  # checks that observe, too
    hook_list.append(gate)  # the fairness accounts: charged at dispatch, corrected at the end
    if predictor is not None:
        hook_list.append(LearningHook(predictor))  # predictions to learn from, first-token correction
    if metrics_on:
        hook_list.append(RouteMetrics(metrics, app[appkeys.ROUTER]))  # each attempt's route, retry, KV savings
    hook_list.append(ToolBoundary(app[appkeys.ROUTER]))  # answers ending in tool calls: their program returns
    hooks = Hooks(hook_list)
    sinks = [sink for sink in (metrics if metrics_on else None, ledger, activity) if sink is not None]
    accounting = Accounting(app[appkeys.ADMISSION], app[appkeys.POLICIES], sinks, hooks, audit=estimator.audit)
    dispatch = Dispatch(
        server=settings.server,
        fleet=fleet,
        router=app[appkeys.ROUTER],  # one router: per-pool pipelines inside it
        hooks=hooks,
        gate=gate,
    )
    common: dict[str, Any] = {
        "server": settings.server,
        "fleet": fleet,
        "hooks": hooks,
        "accounting": accounting,
        "turns": dispatch,
        "metrics": metrics if metrics_on else None,
        "shape_body": shape_body,
        "report_success": report_success,
        "report_failure": report_failure,
    }
    engine = EngineTransport(  # the answer relayed from an engine over HTTP (gateway/request/context.py)
        upstream=app[appkeys.UPSTREAM],
        stalls=StallWatch(fleet, settings.server.first_token_deadline, settings.server.stall_after_s, ejection),
        **common,
    )
    transport: EngineTransport | PoolTransports = engine
    lora_share: SharedAdapters | None = None  # `state: redis`: adapters' uses, demand, loads fleet-wide
    if settings.state.backend == "redis" and settings.state.redis_url:
        lora_share = SharedAdapters.from_url(
            settings.state.redis_url,
            engine.lora,
            fleet,
            prefix=settings.state.key_prefix,
            residency=app[appkeys.ROUTER].residency,
        )
        engine.lora.share = lora_share
    # LoRA adapter demand (docs/autoscaling.md): every process's loads when shared
    app[AUTOSCALER].adapter_loads = lora_share.pool_loads if lora_share is not None else engine.lora.pool_loads
    app[LORA_LOADER] = engine.lora  # the console's adapter view (GET /admin/adapters)
    hosted_calls: HostedCalls | None = None
    if any(pool.config.hosted for pool in fleet.pools.values()):  # hosted providers' pools (transport/hosted.py)
        hosted_calls = HostedCalls(fleet, quotas=quotas)
        await hosted_calls.start()  # credentials, off the loop: refuses to start without them
        transport = PoolTransports(engine, HostedTransport(calls=hosted_calls, **common))
    intake = Intake(
        settings.server,
        app[appkeys.POLICIES],
        fleet,
        estimator,
        precheck=app[appkeys.ADMISSION].precheck,  # no room left: 429 before the prompt is counted
    )
    app[appkeys.DIRECTOR] = Director(
        intake=intake,
        dispatch=dispatch,
        transport=transport,
        accounting=accounting,
        hooks=hooks,
        policies=app[appkeys.POLICIES],
        fleet=fleet,
        start_trace=app[appkeys.TRACING].start_request,
    )
    try:
        # frozen replicas out of routing (gateway/upstream/replica_loss.py); LoRA preloads and idle unloads
        async with watching(engine.stalls), sharing(lora_share), keeping(engine.lora_keeper):
            yield
    finally:
        if hosted_calls is not None:
            await hosted_calls.close()


async def _response_store_ctx(app: web.Application) -> AsyncIterator[None]:
    """Stored responses (Responses API): in memory, or in Redis when `state` says so."""
    settings = app[appkeys.SETTINGS]
    config = settings.apis.response_store
    state = settings.state
    store = None
    if config.enabled:
        redis_url = state.redis_url if state.backend == "redis" else None
        store = make_response_store(config, redis_url, state.key_prefix)
    app[RESPONSE_STORE] = store
    yield
    if store is not None:
        await store.close()


def _allow_labels(metrics: GatewayMetrics, policy: Policy, fleet: Fleet) -> None:
    """Bound label cardinality to what is configured: anything else is reported as `other`."""
    models = set(fleet.models)
    for name, config in policy.config.models.items():
        models.add(name)
        models.update(config.aliases)
    directory = policy.directory
    api_tenants = list(directory.tenants) if directory is not None else []
    metrics.allow_label_values(
        tenants=[*policy.config.tenants.keys(), *api_tenants],
        models=sorted(models),
        pools=fleet.pools.keys(),
        endpoints=[e.id for e in fleet.endpoints()],
        key_ids=[k.id for k in policy.config.keys],
        loras=policy.adapters.keys(),  # LoRA adapters: the `lora_name` label's values (docs/adapters.md)
    )

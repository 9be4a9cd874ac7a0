"""In-process fakes and a builder for the walk's tests: an admission that records every admit, settle
and release, a router that takes the first ready endpoint, a record sink, and the simulated engine
served in this event loop over real sockets. No process is started."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import numpy as np
import orjson
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Fleet, Pool
from backends.types import Endpoint, EndpointState
from gateway.app.settings import ServerSettings
from gateway.flow.checks import PredictsLatency, Saturation, SloHook
from gateway.flow.gate import Check, Gate
from gateway.flow.queue import FlowQueue
from gateway.request import OPEN_GATE, Director, Hook, Hooks
from gateway.request.accounting import Accounting
from gateway.request.director import Dispatch
from gateway.request.intake import Intake
from gateway.request.record import RequestRecord
from gateway.transport.engine import EngineTransport
from gateway.upstream.client import UpstreamClient
from policies.estimate import PromptEstimator
from policies.flow.order import MemoryCounters
from policies.flow.saturation import FlowSettings
from policies.holder import PolicyHolder
from policies.limits.admission import Admitted
from policies.policy import Policy, hash_key
from policies.routing.types import REASON_ONLY, RouteDecision, RouteRequest
from policies.schema import PoliciesConfig
from policies.types import Rejection, RequestFacts, Usage
from predictor.features import NUM_FEATURES, Feature, Prediction, RequestShape

KEY = "sk-walk-test"
SLO_KEY = "sk-walk-slo"
QUEUE_KEY = "sk-walk-queue"


def policy() -> Policy:
    """Models big (falls back to small on rate limits, upstream errors and SLO misses) and small;
    tenant t, and tenants with an SLO class that rejects (slo) or queues (queue) on a miss."""
    doc: dict[str, Any] = {
        "tenants": {"t": {}, "slo": {"slo_class": "strict"}, "queue": {"slo_class": "patient"}},
        "keys": [
            {"id": "k", "tenant": "t", "sha256": hash_key(KEY)},
            {"id": "ks", "tenant": "slo", "sha256": hash_key(SLO_KEY)},
            {"id": "kq", "tenant": "queue", "sha256": hash_key(QUEUE_KEY)},
        ],
        "models": {
            "big": {
                "context_length": 16384,
                "default_max_tokens": 8,
                "fallbacks": [{"model": "small", "triggers": ["rate_limited", "upstream_error", "slo_unattainable"]}],
            },
            "small": {"context_length": 16384, "default_max_tokens": 8},
        },
        "slo_classes": {
            "strict": {"ttft_ms": 100, "on_miss": "reject"},
            "patient": {"ttft_ms": 5000, "on_miss": "queue", "max_queue_ms": 2000},
        },
    }
    return Policy(PoliciesConfig.model_validate(doc))


@dataclass
class RecordingAdmission:
    """Admission's contract, recording what happened to every ticket. `reject` maps a model to the
    rejection its admit answers."""

    reject: dict[str, Rejection] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def admit(self, facts: RequestFacts, model: str, now: float | None = None) -> Admitted | Rejection:
        await asyncio.sleep(0)  # a store's round trip: a point where the client may go away
        if model in self.reject:
            self.events.append(("reject", model))
            return self.reject[model]
        ticket = Admitted((("x-ratelimit-limit-requests", "100"),), model, ticket_id=f"{model}-{next(self._ids)}")
        self.events.append(("admit", ticket.ticket_id))
        return ticket

    async def settle(
        self,
        ticket: Admitted,
        usage: Usage | None,
        *,
        model: str,
        charged_output_tokens: int | None = None,
        pool: str | None = None,
    ) -> None:
        await asyncio.sleep(0)
        self.events.append(("settle", ticket.ticket_id))

    async def release(self, ticket: Admitted) -> None:
        await asyncio.sleep(0)
        self.events.append(("release", ticket.ticket_id))

    def settle_soon(
        self,
        ticket: Admitted,
        usage: Usage | None,
        *,
        model: str,
        charged_output_tokens: int | None = None,
        pool: str | None = None,
    ) -> None:
        self.events.append(("settle", ticket.ticket_id))

    def release_soon(self, ticket: Admitted) -> None:
        self.events.append(("release", ticket.ticket_id))

    def ends(self) -> dict[str, list[str]]:
        """ticket id -> how it ended (settle / release), in order."""
        out: dict[str, list[str]] = {t: [] for kind, t in self.events if kind == "admit"}
        for kind, ticket in self.events:
            if kind in ("settle", "release"):
                out.setdefault(ticket, []).append(kind)
        return out


class FirstReady:
    """A fixed router: the pool's first ready endpoint not excluded."""

    def __init__(self) -> None:
        self.dispatched: list[str] = []

    def route(
        self, request: RouteRequest, pool: Pool, now_s: float, exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        for endpoint in pool.endpoints:
            if endpoint.state is EndpointState.READY and endpoint.id not in exclude:
                return RouteDecision(endpoint, REASON_ONLY, decided_at_s=now_s)
        return None

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        self.dispatched.append(decision.endpoint.id)


class Records:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def observe(self, record: RequestRecord) -> None:
        self.records.append(record)


class ScriptedPredictor:
    """Predicts `ttft_ms` for every endpoint, one value per call from `script` (the last repeats);
    the endpoints look busy (one request running), so an idle endpoint's free pass never applies."""

    def __init__(self, *script: float) -> None:
        self.script = list(script)
        self.calls = 0

    def predict(
        self,
        pool: str,
        request: RequestShape,
        endpoints: Sequence[Endpoint],
        cached_tokens: Sequence[int],
        now_s: float | None = None,
        lower_cached_tokens: Sequence[int] | None = None,
    ) -> list[Prediction]:
        ttft_ms = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        row = np.zeros(NUM_FEATURES, dtype=np.float32)
        row[Feature.RUNNING] = 1
        return [Prediction(e.id, ttft_ms, 10.0, ttft_ms * 1.2, 12.0, "prior", "prior", row) for e in endpoints]


def slo_gate(predictor: PredictsLatency, *, recheck_s: float = 0.01) -> tuple[SloHook, Gate]:
    """The SLO check and the gate it waits in (after flow control's saturation check), as the app
    factory plugs them in."""
    queue = FlowQueue(MemoryCounters(), recheck_s=recheck_s)
    slo = SloHook(predictor=predictor, waiting=queue.waiting_with)
    checks: list[Check] = [Saturation(queue, FlowSettings()), slo]
    return slo, Gate(queue, FlowSettings(), PolicyHolder(policy()), checks=checks)


def fleet(pools: dict[str, list[str]], *, engine_model: str | None = None) -> Fleet:
    """Static pools (model name = pool name) whose endpoints are ready."""
    configs = [
        PoolConfig(
            name=name,
            model=name,
            engine="openai",
            endpoints=[StaticEndpointConfig(url=url) for url in urls],
        )
        for name, urls in pools.items()
    ]
    built = Fleet.from_configs(configs)
    for endpoint in built.endpoints():
        endpoint.state = EndpointState.READY
        endpoint.served_model = engine_model or "llama-3.1-8b"  # what the simulated engines serve
    return built


@dataclass
class Walk:
    director: Director
    admission: RecordingAdmission
    records: Records
    router: FirstReady
    fleet: Fleet
    accounting: Accounting
    upstream: UpstreamClient

    async def settled(self) -> None:
        """Let the loop run what ended requests left (the walk hands settlements over synchronously)."""
        await asyncio.sleep(0)

    def endpoints_idle(self) -> bool:
        return all(
            e.inflight.requests == 0 and e.inflight.prefill_tokens == 0 and e.inflight.decode_tokens == 0
            for e in self.fleet.endpoints()
        )


def build(
    the_fleet: Fleet,
    *,
    admission: RecordingAdmission | None = None,
    hooks: Sequence[Hook] = (),
    gate: Gate | None = None,
    retries: int = 1,
) -> Walk:
    """The walk with `hooks`, and `gate` (its checks that observe, and the gate itself, join the
    hooks as the app factory adds them); without one, everything goes at once."""
    server = ServerSettings(upstream_retries=retries, upstream_connect_timeout_s=2.0, upstream_read_timeout_s=30.0)
    holder = PolicyHolder(policy())
    admission = admission or RecordingAdmission()
    records, router = Records(), FirstReady()
    upstream = UpstreamClient(connect_timeout_s=2.0, read_timeout_s=30.0, idle_timeout_s=4.0)
    all_hooks = list(hooks)
    if gate is not None:
        for hook in [*gate.checks, gate]:
            if isinstance(hook, Hook) and not any(hook is h for h in all_hooks):
                all_hooks.append(hook)
    hook_set = Hooks(all_hooks)
    accounting = Accounting(admission, holder, [records], hook_set)
    dispatch = Dispatch(server=server, fleet=the_fleet, router=router, hooks=hook_set, gate=gate or OPEN_GATE)
    engine = EngineTransport(
        server=server, fleet=the_fleet, upstream=upstream, hooks=hook_set, accounting=accounting, turns=dispatch
    )
    intake = Intake(server, holder, the_fleet, PromptEstimator())
    director = Director(
        intake=intake,
        dispatch=dispatch,
        transport=engine,
        accounting=accounting,
        hooks=hook_set,
        policies=holder,
        fleet=the_fleet,
    )
    return Walk(director, admission, records, router, the_fleet, accounting, upstream)


def chat_request(
    model: str = "big", *, key: str = KEY, stream: bool = False, max_tokens: int = 3, **headers: str
) -> web.Request:
    """A POST /v1/chat/completions as aiohttp hands it to a handler (its body already received)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
    data = orjson.dumps(body)
    loop = asyncio.get_running_loop()
    protocol = mock.Mock(_reading_paused=False)
    payload = StreamReader(protocol, 2**20, loop=loop)
    payload.feed_data(data)
    payload.feed_eof()
    all_headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": "application/json",
        "Content-Length": str(len(data)),
        **{name.replace("_", "-"): value for name, value in headers.items()},
    }
    transport = mock.Mock()  # a direct loopback caller (the operator, for x-tokenway-debug)
    transport.get_extra_info.side_effect = lambda name, default=None: (
        ("127.0.0.1", 40000) if name == "peername" else default
    )
    return make_mocked_request(
        "POST", "/v1/chat/completions", headers=all_headers, payload=payload, transport=transport
    )


def body_json(response: web.StreamResponse) -> Any:
    """The JSON body of an answer the walk returned whole (not streamed)."""
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)
    return orjson.loads(response.body)


class _CancelAt:
    """Awaits a coroutine, cancelling the task that awaits it at its `at`-th suspension (-1: never):
    every await the walk makes is a point where aiohttp may cancel a handler whose client left."""

    def __init__(self, coro: Any, at: int) -> None:
        self.coro = coro
        self.at = at
        self.suspensions = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        inner = self.coro.__await__()
        send: Any = None
        throw: BaseException | None = None
        while True:
            try:
                yielded = inner.throw(throw) if throw is not None else inner.send(send)
            except StopIteration as stop:
                return stop.value
            send, throw = None, None
            if self.suspensions == self.at:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # the awaited future is cancelled as the task suspends on it
            self.suspensions += 1
            try:
                send = yield yielded
            except BaseException as exc:
                throw = exc


async def handle_cancelled_at(walk: Walk, make_request: Callable[[], web.Request], at: int) -> tuple[bool, int]:
    """Run one request, cancelled at suspension `at`; (was it cancelled, suspensions it made)."""
    request = make_request()
    waiter = _CancelAt(walk.director.handle(request, "chat"), at)

    async def run() -> Any:
        return await waiter

    task = asyncio.get_running_loop().create_task(run())
    try:
        await task
        cancelled = False
    except asyncio.CancelledError:
        cancelled = True
    await walk.settled()
    return cancelled, waiter.suspensions

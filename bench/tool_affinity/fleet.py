"""A pool of simulated engines driven in process on a simulated clock, routed by tokenway's router.

Each replica is the simulator's own scheduler and paged KV cache (`sim/scheduler.py`,
`sim/kv_cache.py`: vLLM V1's continuous batching, chunked prefill, prefix caching with LRU eviction
of free cached blocks, preemption by recompute) priced by the simulator's roofline
(`backends.perf.roofline.StepTimer`); no sockets and no wall clock, so a run of many minutes of
traffic takes seconds and every run of a seed sees the same arrivals. The router is the gateway's
(`policies.routing.pipeline.build_router`) over `backends` endpoints whose stats are read from the
engines at every decision (a scrape with no delay) and whose in-flight accounting is kept as the
gateway keeps it (`InFlight` tickets at dispatch, first token and end). When an agent turn's answer
ends in tool calls the bench tells the router as the gateway's `ToolBoundary` hook does.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Pool
from backends.perf import roofline
from backends.perf.presets import resolve_preset
from backends.types import Endpoint, EndpointState, EndpointStats, LoadTicket
from policies.routing.pipeline import ScoringRouter
from policies.routing.types import RouteDecision, RouteRequest
from policies.types import Principal, RequestFacts, RequestSubjects
from sim.kv_cache import HostOffload, KVCacheManager
from sim.scheduler import Request, Scheduler, Step

PRINCIPAL = Principal(key_id="k", tenant="agents", allowed_models=None, priority=0)
BLOCK_SIZE = 16


@dataclass(slots=True)
class Replica:
    endpoint: Endpoint
    kv: KVCacheManager
    scheduler: Scheduler
    timer: roofline.StepTimer
    step: Step | None = None  # the step in progress


@dataclass(slots=True)
class Job:
    """One request in the pool: what the caller is told when it finishes."""

    facts: RequestFacts
    decision: RouteDecision
    ticket: LoadTicket
    req: Request
    done: Callable[[Job, float], None]
    arrival_s: float
    noted_first: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class SimPool:
    def __init__(
        self,
        router: ScoringRouter,
        replicas: int,
        *,
        preset: str,
        kv_blocks: int,
        max_num_seqs: int,
        offload_blocks: int = 0,
        offload_bandwidth: float = 25e9,
    ) -> None:
        """`offload_blocks` > 0: each replica also keeps a host-DRAM tier of that many blocks, loaded at
        `offload_bandwidth` B/s (`sim/kv_cache.py`, `HostOffload`: HBM evictions land there)."""
        self.router = router
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        names = [f"r{i}" for i in range(replicas)]
        self.pool = Pool(
            PoolConfig(name="agents", model="m", endpoints=[StaticEndpointConfig(url=f"http://{n}") for n in names])
        )
        self.replicas: dict[str, Replica] = {}
        resolved = resolve_preset(preset)
        for name in names:
            endpoint = Endpoint(
                id=f"agents/{name}",
                pool="agents",
                base_url=f"http://{name}",
                engine="sim",
                served_model="m",
                state=EndpointState.READY,
                max_model_len=131_072,
                stats=EndpointStats(block_size=BLOCK_SIZE, num_gpu_blocks=kv_blocks),
            )
            kv = KVCacheManager(kv_blocks, BLOCK_SIZE, True)
            kv.pool.record_events = False  # nobody subscribes: the router's index is the approximate one
            if offload_blocks:
                per_block = BLOCK_SIZE * roofline.kv_bytes_per_token_per_device(resolved)
                HostOffload(offload_blocks, offload_bandwidth, per_block).attach(kv)
            self.pool.endpoints.append(endpoint)
            self.replicas[endpoint.id] = Replica(
                endpoint, kv, Scheduler(kv, max_num_seqs, 8192, 30.0), roofline.StepTimer(resolved)
            )
        self._jobs: dict[str, Job] = {}
        self.ids = itertools.count()

    # -- the clock ---------------------------------------------------------------------------------

    def at(self, when_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when_s, next(self._seq), action))

    def run(self, until_s: float) -> None:
        while self._events and self._events[0][0] <= until_s:
            when, _, action = heapq.heappop(self._events)
            self.now = when
            action()

    # -- requests ----------------------------------------------------------------------------------

    def send(
        self,
        prompt: list[int],
        output_tokens: int,
        done: Callable[[Job, float], None],
        *,
        program: str | None = None,
        session: str | None = None,
        **extra: Any,
    ) -> Job:
        """Route and submit one request now; `done(job, now)` when it finishes."""
        rid = f"q{next(self.ids)}"
        facts = RequestFacts(
            request_id=rid,
            api="chat",
            body={},
            requested_model="m",
            model="m",
            principal=PRINCIPAL,
            prompt_tokens=len(prompt),
            prompt_token_ids=array("I", prompt),
            max_tokens=output_tokens,
            subjects=RequestSubjects(program=program),
            session_key=session,
        )
        self._scrape()
        routing = RouteRequest(facts)
        decision = self.router.route(routing, self.pool, self.now)
        assert decision is not None
        self.router.on_dispatch(routing, decision)
        endpoint = decision.endpoint
        ticket = endpoint.inflight.begin(decision.uncached_prefill_tokens(len(prompt)))
        req = Request(
            request_id=rid,
            prompt_ids=prompt,
            output_ids=[(i * 7919 + len(prompt)) % 30_000 + 1 for i in range(output_tokens)],
            stop_reason_at_end="length",
            arrival_s=self.now,
            max_tokens=output_tokens,
        )
        job = Job(facts, decision, ticket, req, done, self.now, extra=extra)
        self._jobs[rid] = job
        replica = self.replicas[endpoint.id]
        replica.scheduler.add(req)
        if replica.step is None:
            self._start_step(replica)
        return job

    def _scrape(self) -> None:
        """Every engine's load as its metrics would say it now (no scrape delay)."""
        for replica in self.replicas.values():
            stats = replica.endpoint.stats
            stats.running = len(replica.scheduler.running)
            stats.waiting = replica.scheduler.num_waiting
            stats.kv_usage_ratio = replica.kv.usage
            stats.scraped_at_s = self.now

    # -- the engines ---------------------------------------------------------------------------------

    def _start_step(self, replica: Replica) -> None:
        scheduler = replica.scheduler
        step: Step | None = None
        for _ in range(4):  # a step that only preempted or started pulls is scheduled again at once
            if not (scheduler.running or scheduler.waiting or scheduler.pulling):
                break
            step = scheduler.schedule(self.now)
            if not step.empty:
                break
            if not step.preempted:
                break
        else:
            step = None
        if step is None or step.empty:
            replica.step = None
            landing = scheduler.next_pull_s()  # a prefix loading from host DRAM: wake when it lands
            if landing is not None:
                self.at(max(landing, self.now), lambda: self._wake(replica))
            return
        chunks = [(n, ctx) for _, n, ctx in step.prefills]
        duration = replica.timer(chunks, len(step.decodes), step.decode_context_sum)
        replica.step = step
        self.at(self.now + duration, lambda: self._end_step(replica, step))

    def _wake(self, replica: Replica) -> None:
        if replica.step is None:
            self._start_step(replica)

    def _end_step(self, replica: Replica, step: Step) -> None:
        for req in replica.scheduler.complete_step(step, self.now):
            job = self._jobs.get(req.request_id)
            if job is None:
                continue
            if not job.noted_first and req.first_token_s is not None:
                job.noted_first = True
                job.ticket.first_token(req.num_prompt + len(req.output_ids))
            if req.finished:
                del self._jobs[req.request_id]
                job.ticket.end()
                job.done(job, self.now)
        replica.scheduler.stats.clear()
        self._start_step(replica)

"""The autoscaler: gathers each autoscaled pool's signals, plans, shares the budget, acts.

One pass every `interval_s` (the shortest of the autoscaled pools'), and at once when a request is
held for a pool with nothing serving, or a device was freed (a cold start or a model switch should
not wait for the next tick):

    traffic (below) -> forecasts (policies/autoscale/forecast.py)
    velocities at the SLO (predictor/prior.py) + replicas, KV, queue -> PoolSignals
    plan_pool per pool -> share_budget across pools -> Executor.apply

What it decided, why, and the signals it decided on are kept (bounded) for `/admin/pools`, the
metrics and the benchmark's recorded inputs. The traffic records it plans from (below) are kept
here, with the loop that owns them: it holds one per pool, feeds it from the walk's hook (`arrived`,
`finished`) and samples it each pass.

Traffic: what the gateway sees of each autoscaled pool
------------------------------------------------------

What the gateway sees of each autoscaled pool's traffic: token rates, the request mix, speed.

Every request is counted when it arrives for a pool (held or not), so a pool at zero replicas still
shows its demand: its uncached prompt tokens (the prompt less the pool's recent cache-hit share)
and its expected output tokens (the pool's recent mean output). At the end of each request the mix
(mean uncached prompt, mean output) and the cache-hit share learn from what really happened, and a
finished stream's measured TPOT beside the batch it decoded in calibrates the capacity model.
Until the first request of a pool finishes, the mix follows the arrivals instead (their prompts,
their `max_tokens` as the output bound): a cold pool's first plan would otherwise size replicas for a
default mix (a code pool's long prompts and short outputs read as five times the prefill work per
replica it really is), and the first scale-up is the one that decides a cold start.
The arrival times since the last sample are kept too (bounded): when a window reads as a step up, the
planning loop measures the new rate over the window's second half, as a burst that began mid-window
is diluted by the half before it.
Bounded: one small record per configured pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from backends.autoscale.devices import group_of
from backends.autoscale.executor import Executor
from backends.fleet import Fleet, Pool
from backends.types import EndpointState, Role
from policies.autoscale import forecast as scheduled
from policies.autoscale.budget import Claim, share_budget
from policies.autoscale.forecast import Forecast, stepped_up
from policies.autoscale.planner import PLANNERS, replica_load
from policies.autoscale.types import PlannerMemory, PoolPlan, PoolSignals, RoleSignals
from predictor.config import PriorSettings
from predictor.prior import Calibration, LatencyPrior, Mix, replica_velocity

_MIX_WEIGHT = 0.05  # EWMA weight of one request in the mix
_TIMES_KEPT = 4096  # arrival times of one window (more arrivals: the newest are kept)
_DEFAULT_MIX = Mix()


@dataclass(slots=True)
class PoolTraffic:
    prefill_tokens: float = 0.0  # since the last sample
    decode_tokens: float = 0.0
    requests: int = 0
    total_requests: int = 0
    last_request_s: float = float("-inf")
    prompt_tokens: float = _DEFAULT_MIX.prompt_tokens  # EWMA of uncached prompt tokens
    output_tokens: float = _DEFAULT_MIX.output_tokens  # EWMA of output tokens
    cached_share: float = 0.0
    seen: int = 0  # finished requests folded into the mix
    guessed: int = 0  # arrivals folded into the mix while none has finished
    calibration: Calibration = field(default_factory=Calibration)
    times: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMES_KEPT))  # since the last take

    def arrived(self, prompt_tokens: int, max_output: int | None, now_s: float) -> None:
        uncached = prompt_tokens * (1.0 - self.cached_share)
        if self.seen == 0:  # nothing finished yet: what the requests say about themselves
            weight = 1.0 if self.guessed == 0 else _MIX_WEIGHT
            self.guessed += 1
            self.prompt_tokens += weight * (uncached - self.prompt_tokens)
            if max_output is not None:
                bound = min(float(max(max_output, 1)), _DEFAULT_MIX.output_tokens)
                self.output_tokens += weight * (bound - self.output_tokens)
        expected = self.output_tokens if max_output is None else min(self.output_tokens, max_output)
        self.prefill_tokens += uncached
        self.decode_tokens += expected
        self.requests += 1
        self.total_requests += 1
        self.last_request_s = now_s
        self.times.append(now_s)

    def finished(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        if prompt_tokens <= 0:
            return
        weight = 1.0 if self.seen == 0 else _MIX_WEIGHT
        self.seen += 1
        uncached = max(prompt_tokens - cached_tokens, 0)
        self.prompt_tokens += weight * (uncached - self.prompt_tokens)
        self.output_tokens += weight * (max(output_tokens, 1) - self.output_tokens)
        self.cached_share += weight * (min(cached_tokens / prompt_tokens, 1.0) - self.cached_share)

    def take(self) -> tuple[float, float, int]:
        """(prefill tokens, decode tokens, requests) since the last call."""
        taken = (self.prefill_tokens, self.decode_tokens, self.requests)
        self.prefill_tokens = self.decode_tokens = 0.0
        self.requests = 0
        self.times.clear()
        return taken

    def arrived_since(self, since_s: float) -> int:
        """Arrivals of the current window at or after `since_s`."""
        count = 0
        for at_s in reversed(self.times):
            if at_s < since_s:
                break
            count += 1
        return count

    @property
    def mix(self) -> Mix:
        return Mix(max(self.prompt_tokens, 1.0), max(self.output_tokens, 1.0))


log = logging.getLogger("tokenway.autoscale")

_DECISIONS_KEPT = 32
_SIGNALS_KEPT = 64
_MIN_PASS_GAP_S = 0.1
_MIN_WINDOW_SHARE = 0.5  # a rate is measured over at least this share of the interval

QueuedSource = Callable[[str], tuple[int, float]]  # pool -> (requests waiting, their prompt tokens)


class Autoscaler:
    def __init__(
        self,
        fleet: Fleet,
        executor: Executor,
        prior: PriorSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.executor = executor
        self.clock = clock
        self.pools: list[Pool] = [p for p in fleet.pools.values() if p.config.elastic]
        self.traffic: dict[str, PoolTraffic] = {p.name: PoolTraffic() for p in self.pools}
        self.forecasts: dict[str, tuple[Forecast, Forecast]] = {p.name: (Forecast(), Forecast()) for p in self.pools}
        self.arrivals: dict[str, Forecast] = {p.name: Forecast() for p in self.pools}  # requests/s
        self.steps: dict[str, int] = {p.name: 0 for p in self.pools}  # windows read as a step up
        # launching the initial replicas is the first scale-up: the scale-down cooldown and the idle
        # time count from it
        started = clock()
        for pool in self.pools:
            if any(pool.config.initial_roles().values()):
                self.traffic[pool.name].last_request_s = started
        self.memory: dict[str, PlannerMemory] = {
            p.name: PlannerMemory(last_up_s=started if any(p.config.initial_roles().values()) else float("-inf"))
            for p in self.pools
        }
        self.plans: dict[str, PoolPlan] = {}
        self.signals: dict[str, deque[PoolSignals]] = {p.name: deque(maxlen=_SIGNALS_KEPT) for p in self.pools}
        self.decisions: dict[str, deque[dict[str, Any]]] = {p.name: deque(maxlen=_DECISIONS_KEPT) for p in self.pools}
        self.priors = {p.name: LatencyPrior.for_pool(p.config, prior or PriorSettings()) for p in self.pools}
        # floors set through the admin API (`set_floor`), at most floors.MAX_FLOORS per pool
        self.floors: dict[str, list[scheduled.Floor]] = {p.name: [] for p in self.pools}
        self.windows = {p.name: p.config.autoscale.windows() for p in self.pools if p.config.autoscale}
        self.wall_clock: Callable[[], float] = time.time
        self.held: Callable[[str], int] = lambda pool: 0
        self.queued: QueuedSource = lambda pool: (0, 0.0)
        # LoRA adapter loads on demand per pool since start (the engine transport's loader): adapter demand
        self.adapter_loads: Callable[[str], int] = lambda pool: 0
        self._adapter_loads: dict[str, tuple[int, float]] = {}  # pool -> (count at the last window, its rate)
        self.interval_s = min((p.config.autoscale.interval_s for p in self.pools if p.config.autoscale), default=5.0)
        self._poke = asyncio.Event()
        self._last_pass_s = float("-inf")
        self._last_sample_s: float | None = None
        self.passes = 0

    @property
    def enabled(self) -> bool:
        return bool(self.pools)

    # --- what the gateway tells it ---------------------------------------------------------------

    def arrived(self, pool: str, prompt_tokens: int, max_output: int | None) -> None:
        traffic = self.traffic.get(pool)
        if traffic is not None:
            now = self.clock()
            traffic.arrived(prompt_tokens, max_output, now)
            self.executor.note_request(pool, now)

    def finished(
        self, pool: str, prompt_tokens: int, cached_tokens: int, output_tokens: int, tpot_ms: float | None, batch: int
    ) -> None:
        traffic = self.traffic.get(pool)
        if traffic is None:
            return
        traffic.finished(prompt_tokens, cached_tokens, output_tokens)
        if tpot_ms and batch:
            context = batch * (prompt_tokens + output_tokens / 2)
            traffic.calibration.observe(self.priors[pool], tpot_ms, batch, context)

    def pool_floors(self, pool: str, now_s: float | None = None) -> tuple[scheduled.Floor, ...]:
        """The floors of `pool` near now: the admin API's and its schedule's open or next windows."""
        now = self.clock() if now_s is None else now_s
        book = self.floors.get(pool, [])
        book[:] = scheduled.keep(book, now)
        windows = scheduled.schedule_floors(self.windows.get(pool, ()), self.wall_clock(), now)
        return (*book, *windows)

    def roles(self, pool: str) -> list[str]:
        """The roles the planner sizes in `pool` (none: not autoscaled)."""
        found = next((p for p in self.pools if p.name == pool), None)
        return [r.value for r in _roles(found)] if found is not None else []

    def set_floor(
        self, pool: str, min_replicas: int, start_in_s: float, for_s: float, role: str = ""
    ) -> scheduled.Floor:
        """A one-off floor from `start_in_s` for `for_s` (the pool's ended floors are dropped first);
        ValueError when the pool already holds MAX_FLOORS that have not ended."""
        now = self.clock()
        book = self.floors[pool]
        book[:] = scheduled.keep(book, now)
        if len(book) >= scheduled.MAX_FLOORS:
            raise ValueError(
                f"pool {pool!r} holds {len(book)} floors that have not ended (at most {scheduled.MAX_FLOORS})"
            )
        floor = scheduled.Floor(now + start_in_s, now + start_in_s + for_s, min_replicas, role)
        book.append(floor)
        self.poke()
        return floor

    def clear_floors(self, pool: str) -> int:
        """Drop the admin API's floors of `pool` (the schedule's stay: they change with the config)."""
        dropped = len(scheduled.keep(self.floors[pool], self.clock()))
        self.floors[pool].clear()
        self.poke()
        return dropped

    def poke(self) -> None:
        """Plan now (a request is held, a device was freed)."""
        self._poke.set()

    # --- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: 3.11's wait_for can swallow a cancel
                async with asyncio.timeout(self.interval_s):
                    await self._poke.wait()
            self._poke.clear()
            gap = _MIN_PASS_GAP_S - (self.clock() - self._last_pass_s)
            if gap > 0:
                await asyncio.sleep(gap)
                self._poke.clear()
            try:
                self.tick()
            except Exception:  # one bad pass must not end autoscaling
                log.exception("autoscale: planning pass failed")

    def tick(self) -> list[PoolPlan]:
        now = self.clock()
        self._last_pass_s = now
        self.passes += 1
        # A pass off the schedule (a held request, a freed device) can come a fraction of a second after
        # the last: rates over so short a window are noise (a few Poisson arrivals over 0.1 s read as a
        # burst, and the trend divides by the window). Such a pass plans on the forecast as it stands;
        # its tokens stay counted for the next full window.
        dt = None if self._last_sample_s is None else now - self._last_sample_s
        fold = dt is None or dt >= self.interval_s * _MIN_WINDOW_SHARE
        if fold:
            self._last_sample_s = now
        else:
            dt = 0.0
        claims: list[Claim] = []
        for pool in self.pools:
            signals = self._signals(pool, now, dt)
            self.signals[pool.name].append(signals)
            policy = pool.config.autoscale
            assert policy is not None
            plan = PLANNERS[policy.planner](signals, policy, self.memory[pool.name])
            self.memory[pool.name] = plan.memory
            minimums = {r.role: policy.bounds(r.role)[0] for r in signals.roles}
            maximums = {r.role: policy.bounds(r.role)[1] for r in signals.roles}
            min_awake = pool.config.share.min_awake_s if pool.config.share is not None else 0.0
            claims.append(Claim(plan, signals, policy.priority, minimums, min_awake, maximums))
        plans = share_budget(claims, self.executor.capacity())
        for plan in plans:
            previous = self.plans.get(plan.pool)
            if previous is None or [r.desired for r in previous.roles] != [r.desired for r in plan.roles]:
                self.decisions[plan.pool].append(
                    {
                        "at_unix_s": round(time.time(), 3),
                        "current": {r.role: r.current for r in plan.roles},
                        "desired": {r.role: r.desired for r in plan.roles},
                        "reason": plan.reason,
                    }
                )
            self.plans[plan.pool] = plan
        self.executor.apply(plans)
        return plans

    def _signals(self, pool: Pool, now: float, dt: float | None) -> PoolSignals:
        config = pool.config
        policy = config.autoscale
        assert policy is not None
        traffic = self.traffic[pool.name]
        roles = []
        for role in _roles(pool):
            ready = [e for e in pool.endpoints if e.launched and e.role is role and e.state is EndpointState.READY]
            kv_tokens = next((e.stats.kv_capacity_tokens for e in ready if e.stats.kv_capacity_tokens), None)
            velocity = replica_velocity(
                self.priors[pool.name],
                traffic.mix,
                ttft_slo_ms=policy.ttft_slo_ms,
                tpot_slo_ms=policy.tpot_slo_ms,
                role=role.value,
                kv_tokens=kv_tokens,
                factor=traffic.calibration.factor,
            )
            kv = sum(e.stats.kv_usage_ratio for e in ready) / len(ready) if ready else 0.0
            roles.append(
                RoleSignals(
                    role.value,
                    self.executor.role_state(pool.name, role),
                    velocity.prefill_tps,
                    velocity.decode_tps,
                    kv_usage=round(kv, 4),
                    engine_waiting=sum(e.stats.waiting for e in ready),
                    engine_running=sum(e.stats.running for e in ready),
                )
            )
        prefill, decode = self.forecasts[pool.name]
        if dt is None:  # the first pass: no window to measure yet
            traffic.take()
        elif dt > 0:
            late = traffic.arrived_since(now - dt / 2)
            prefill_tokens, decode_tokens, requests = traffic.take()
            alpha, beta = policy.forecast_alpha, policy.forecast_beta
            arrivals = self.arrivals[pool.name]
            expected = arrivals.ahead(dt / 2) * dt  # the window's count on the forecast's line
            step = arrivals.at_s != 0.0 and stepped_up(requests, expected, policy.forecast_step_z)
            # a step that began mid-window: its rate is the window's second half's (up to 2x the mean)
            scale = max(1.0, 2.0 * late / requests) if step else 1.0
            rates = (prefill_tokens / dt * scale, decode_tokens / dt * scale)
            if step and not _outgrows(roles, *rates, policy.target_utilization):
                # a cluster of arrivals the replicas running absorb (a trace's arrivals are burstier
                # than Poisson): taken at once it would pin the scale-down's stabilisation window
                step, scale = False, 1.0
            self.steps[pool.name] += step
            self.arrivals[pool.name] = arrivals.update(requests / dt * scale, now, alpha, beta, step=step)
            prefill = prefill.update(prefill_tokens / dt * scale, now, alpha, beta, step=step)
            decode = decode.update(decode_tokens / dt * scale, now, alpha, beta, step=step)
            self.forecasts[pool.name] = (prefill, decode)
        adapter_rate = self._adapter_rate(pool, dt)
        held = self.held(pool.name)
        queued, queued_tokens = self.queued(pool.name)
        # the backlog: prompt tokens waiting in the gateway, plus those dispatched and not yet prefilled
        queued_tokens += sum(e.inflight.prefill_tokens for e in pool.endpoints)
        lead = self.executor.lead
        return PoolSignals(
            pool=pool.name,
            now_s=now,
            prefill=prefill,
            decode=decode,
            roles=tuple(roles),
            queued_requests=queued + held,
            queued_tokens=queued_tokens,
            held=held,
            inflight=sum(e.inflight.requests for e in pool.endpoints),
            last_request_s=traffic.last_request_s,
            startup_s=lead.startup_s(pool.name),
            wake_s=lead.wake_s(pool.name),
            devices_per_replica=self.executor.devices_per_replica(pool.name),
            device_group=group_of(config),
            awake_since_s=self.executor.awake_since_s.get(pool.name, float("-inf")),
            floors=self.pool_floors(pool.name, now),
            adapter_loads_per_min=adapter_rate,
        )

    def _adapter_rate(self, pool: Pool, dt: float | None) -> float:
        """LoRA adapter loads on demand per minute per ready replica over the window `dt` (the last rate
        on a pass off the schedule; 0 on the first)."""
        count = self.adapter_loads(pool.name)
        seen, rate = self._adapter_loads.get(pool.name, (count, 0.0))
        if dt is None:
            rate = 0.0
        elif dt > 0:
            ready = sum(1 for e in pool.endpoints if e.state is EndpointState.READY)
            rate = round(max(count - seen, 0) / dt * 60.0 / max(ready, 1), 3)
        else:
            count = seen
        self._adapter_loads[pool.name] = (count, rate)
        return rate

    # --- what operators see ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """`GET /admin/pools`: per pool, current vs desired per role, why, and what happened."""
        pools = []
        now = self.clock()
        for pool in self.pools:
            name = pool.name
            plan = self.plans.get(name)
            traffic = self.traffic[name]
            prefill, decode = self.forecasts[name]
            last = self.signals[name][-1] if self.signals[name] else None
            roles = {}
            for role in _roles(pool):
                state = self.executor.role_state(name, role)
                role_plan = plan.role(role.value) if plan is not None else None
                signals = last.role(role.value) if last is not None else None
                roles[role.value] = {
                    "current": state.active,
                    "desired": role_plan.desired if role_plan else None,
                    "wanted": role_plan.wanted if role_plan else None,
                    "need": role_plan.need if role_plan else None,
                    "replicas": asdict(state),
                    "velocity_tps": {
                        "prefill": round(signals.prefill_velocity, 1) if signals else None,
                        "decode": round(signals.decode_velocity, 1) if signals else None,
                    },
                    "kv_usage": signals.kv_usage if signals else None,
                }
            pools.append(
                {
                    "name": name,
                    "model": pool.config.model,
                    "reason": plan.reason if plan else "not planned yet",
                    "roles": roles,
                    "forecast_tps": {
                        "prefill": {"level": round(prefill.level, 1), "trend": round(prefill.trend, 2)},
                        "decode": {"level": round(decode.level, 1), "trend": round(decode.trend, 2)},
                        "requests_per_s": round(self.arrivals[name].level, 3),
                        "steps_up": self.steps[name],
                    },
                    "mix": {
                        "prompt_tokens": round(traffic.mix.prompt_tokens, 1),
                        "output_tokens": round(traffic.mix.output_tokens, 1),
                    },
                    "calibration": round(traffic.calibration.factor, 3),
                    "adapter_loads_per_min": self._adapter_loads.get(name, (0, 0.0))[1],
                    "held": self.held(name),
                    "floors": [scheduled.view(f, now) for f in self.pool_floors(name, now)],
                    "startup_s": round(self.executor.lead.startup_s(name), 3),
                    "wake_s": round(self.executor.lead.wake_s(name), 3),
                    "measured": self.executor.lead.measured(name),
                    "drain_timeouts": self.executor.drain_timeouts.get(name, 0),
                    "scale_events": {
                        "up": self.executor.scale_events.get((name, "up"), 0),
                        "down": self.executor.scale_events.get((name, "down"), 0),
                    },
                    "decisions": list(self.decisions[name]),
                    "events": [asdict(e) for e in self.executor.events if e.pool == name][-_DECISIONS_KEPT:],
                }
            )
        return {
            "interval_s": self.interval_s,
            "passes": self.passes,
            "capacity": self.executor.capacity(),
            "pools": pools,
        }

    def recorded(self, pool: str) -> list[dict[str, Any]]:
        """The last signals planned on (the planner tests' recorded inputs)."""
        return [asdict(s) for s in self.signals.get(pool, ())]


def _outgrows(roles: list[RoleSignals], prefill_tps: float, decode_tps: float, utilization: float) -> bool:
    """Whether these token rates need more replicas of some role than it has serving or starting: a
    step only then is worth taking at once."""
    return any(replica_load(r, prefill_tps, decode_tps) / utilization > r.replicas.active for r in roles)


def _roles(pool: Pool) -> list[Role]:
    config = pool.config
    if config.roles is not None:
        return [Role(r) for r in ("prefill", "decode") if config.autoscale and config.autoscale.bounds(r)[1]]
    return [Role.BOTH]

"""One simulated engine: the step loop that turns schedules into simulated time and visible tokens,
the clock that keeps simulated time apart from host latency, and vLLM's sleep mode.

Loop: schedule a step (scheduler.py), price it (roofline.py), sleep until its simulated end is
due (the clock below), then reveal its tokens, update metrics, publish KV events and call the
`notify` of the requests that changed (a stream's notify writes its new tokens to the socket,
generation.py; the others wake their handler once finished). Tokens therefore appear only when
their step ends, and TTFT, TPOT and queueing come out of the schedule rather than a per-request
formula.

When the host falls behind real time, a step's end is already due when it is priced: the loop then
ends it at once and runs on (for up to `BURST_S` of real time before yielding to the other engines
and the HTTP side), telling each request once for all those steps: one socket write carries several
steps' tokens, which is what lets an overloaded process catch up. First tokens are never held back.

PD (NixlConnector semantics): a prefill leg (`do_remote_decode`) finishes after its one token and
keeps its blocks pinned for `kv_lease_s`; a decode leg (`do_remote_prefill`) reserves blocks for
the prompt, asks the prefill instance (HTTP ``POST /internal/kv_pull`` at remote_host:remote_port)
to hand over the pinned KV, waits bytes / link bandwidth in simulated time, then decodes with the
prompt counted as cached. If the prefill instance does not know the request (unknown, expired,
unreachable), the decode leg recomputes the prompt (``kv_load_failure_policy: recompute``).

The clock
---------
`SimClock`, the simulated clock of one engine: step durations in, real sleeps out, host latency
left out.

Simulated time advances only by computed step durations while the engine is busy; the engine sleeps
so that simulated time tracks real time x `time_scale`. When the host falls behind (a loaded CPU, many
engines in one process), the clock re-anchors instead of catching up, so simulated latencies never
include host delays.

While idle, simulated time follows the wall clock, but only to stamp arrivals: the gaps between
clients' requests are real (scaled). The next step starts at the latest of the last step's end and
the arrival (or KV-transfer landing) that woke the engine, never at the moment the event loop got
round to it, so wake-up latency is not simulated time either. At a 10x scale, 1 ms of host latency
would otherwise be 10 ms of fake queueing.

Arrivals during a step map into that step's simulated interval (never later than its end), which is
what makes a request arriving mid-step wait for the next step, as on a real engine.

Sleep mode
----------
`SleepMode` and `install`, vLLM's sleep mode on the simulated engine: `POST /sleep`,
`POST /wake_up`, `GET /is_sleeping`.

As in vLLM, the routes exist only when the server runs in development mode (``VLLM_SERVER_DEV_MODE=1``)
and the engine with ``--enable-sleep-mode``; otherwise they answer 404.

- ``POST /sleep?level=1|2&mode=abort|wait|keep`` (defaults 1, abort): `abort` ends every request in
  the engine at once (finish reason ``abort``), `wait` lets them finish first, `keep` holds them in the
  queue and recomputes them after the wake-up. Then the KV cache is dropped (``AllBlocksCleared``) and
  level 1 copies the weights to host memory over PCIe; level 2 discards them. The response comes when
  the engine is asleep. Sleeping twice is a no-op, as in vLLM.
- ``POST /wake_up[?tags=weights&tags=kv_cache]``: brings back the tagged memory (all of it by default)
  and answers once it is back: weights over PCIe after level 1, reloaded from storage after level 2
  (`backends/perf/roofline.py`). The engine is awake when no tag is left asleep.
- ``GET /is_sleeping`` → ``{"is_sleeping": bool}``.

While asleep, or going to sleep, the routes that need the weights (chat, completions, embeddings,
responses, messages) answer 503 with vLLM's ``ModelSleepingError`` body; `/tokenize`, `/v1/models`,
`/health` and `/metrics` keep working. `vllm:engine_sleep_state` (``awake``, ``weights_offloaded``, ``discard_all``)
is exported by `metrics.py`; each operation's simulated duration goes to
`vllm:sleep_mode_operation_duration_seconds{operation}`. Durations are simulated seconds, slept in
real time divided by the engine's time scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import orjson
from aiohttp import web

from backends.perf import roofline
from backends.types import UNKNOWN, Topology, link_class
from sim import text_gen
from sim.config import EngineConfig
from sim.kv_cache import HostOffload, KVCacheManager
from sim.kv_events import KVEventPublisher
from sim.kv_store import RemoteStore
from sim.lora import LoraSlots, batch_adapters
from sim.metrics import EngineMetrics
from sim.scheduler import Request, Scheduler, Status, new_id

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

log = logging.getLogger("tokenway.sim")

# Real seconds the loop may spend ending overdue steps back to back (when behind real time) before
# it hands their tokens to the streams and lets the other engines and the HTTP side run.
BURST_S = 0.001


class SimEngine:
    def __init__(self, config: EngineConfig, instance_index: int = 0) -> None:
        self.config = config
        self.preset = config.preset
        self.instance_index = instance_index
        self.kv = KVCacheManager(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        if config.kv_offload_blocks:
            HostOffload.for_config(config).attach(self.kv)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.kv_lease_s)
        self.clock = SimClock(config.time_scale)
        self.step_time = roofline.StepTimer(self.preset)
        self.metrics = EngineMetrics(config)
        self.lora: LoraSlots | None = None  # --enable-lora (sim/lora.py)
        if config.enable_lora:
            self.lora = LoraSlots(
                config.max_loras,
                load_bandwidth=config.lora_load_bandwidth,
                base_model=config.served_model_name,
                memory_budget=config.lora_memory_budget,
            )
            for name, path in config.lora_modules.items():
                self.lora.register(name, path)
        self.scheduler.lora = self.lora
        self.publisher: KVEventPublisher | None = None
        self.store: RemoteStore | None = None  # the KV store shared with other engines (--kv-store-url)
        self.advertised_host = "127.0.0.1"
        self.advertised_port = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._pull_tasks: set[asyncio.Task[None]] = set()
        self._last_arrival_s = 0.0
        self._http_pulls = 0  # pulls waiting on the prefill instance's HTTP answer
        self.last_pull_link: str | None = None  # the link class of the last PD pull (tests, metrics)
        self.steps = 0
        self.metrics.state_source = self._state
        self.metrics.offload_source = self._offload_traffic
        # Asleep (sleep mode, below): the loop runs no step; queued requests wait for the wake-up.
        self.paused = False
        self._drained = asyncio.Event()  # set whenever the loop finds nothing to run
        self.sleep_mode = SleepMode(self)
        self.metrics.sleep_level_source = self.sleep_mode.state_level

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.config.kv_events is not None:
            self.publisher = KVEventPublisher(self.config.kv_events, self.config.block_size, self.instance_index)
        if self.config.kv_store_url is not None:
            await self._join_store(self.config.kv_store_url)
        self.kv.pool.record_events = self.publisher is not None or self.store is not None
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")
        self._task.add_done_callback(self._engine_died)

    @property
    def alive(self) -> bool:
        """False once the step loop has stopped (vLLM's /health then answers 503)."""
        return self._task is not None and not self._task.done()

    @staticmethod
    def _engine_died(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("simulated engine loop died", exc_info=task.exception())

    async def _join_store(self, url: str) -> None:
        """Follow the store's feed and send it what this engine computes (in the background: a store
        that is not up yet is waited for while the engine serves)."""
        offload = self.kv.offload
        assert offload is not None  # build_engine_config gives an engine with a store a DRAM tier
        pool = self.kv.pool  # its event list is replaced at every drain: append to the current one
        self.store = RemoteStore(url, offload.bytes_per_block, lambda events: pool.events.extend(events))
        offload.store = self.store
        await self.store.start()

    async def stop(self) -> None:
        if self.store is not None:
            await self.store.stop()
        for task in [self._task, *self._pull_tasks]:
            if task is not None:
                task.cancel()
        for task in [self._task, *self._pull_tasks]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._session is not None:
            await self._session.close()
        if self.publisher is not None:
            await self.publisher.close()

    # --- requests --------------------------------------------------------------------------------

    def create_request(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int | None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        request_id: str | None = None,
        pooling: bool = False,
        lora_name: str | None = None,
    ) -> Request:
        """Plan a request's output (deterministic ids and length) and stamp its arrival. A pooling
        request (an embedding) only runs its prompt through the model."""
        arrival = self.clock.now()
        self._last_arrival_s = max(self._last_arrival_s, arrival)
        if pooling:
            return Request(
                request_id=request_id or new_id(),
                prompt_ids=prompt_ids,
                output_ids=[],
                stop_reason_at_end="stop",
                arrival_s=arrival,
                max_tokens=0,
                cache_salt=cache_salt,
                pooling=True,
                lora_name=lora_name,
            )
        limit = self.config.max_model_len - len(prompt_ids)
        budget = limit if max_tokens is None else min(max_tokens, limit)
        rng = text_gen.request_rng(prompt_ids, self.config.seed)
        if ignore_eos:
            length, reason = budget, "length"
        else:
            natural = max(text_gen.natural_length(rng, self.config.output_len_mean), min_tokens)
            length, reason = (natural, "stop") if natural < budget else (budget, "length")
        params = kv_transfer_params or {}
        remote_decode = bool(params.get("do_remote_decode"))
        remote_prefill = params if params.get("do_remote_prefill") else None
        return Request(
            request_id=request_id or new_id(),
            prompt_ids=prompt_ids,
            output_ids=text_gen.generate_ids(rng, max(1, length)),
            stop_reason_at_end=reason,
            arrival_s=arrival,
            max_tokens=budget,
            cache_salt=cache_salt,
            lora_name=lora_name,
            remote_prefill=remote_prefill,
            remote_decode=remote_decode,
        )

    def submit(self, req: Request) -> None:
        """Queue the request; it reaches the scheduler after the preset's frontend latency (the API
        server's share of TTFT: parsing, tokenising, the hop to the engine core)."""
        delay = self.preset.efficiency.frontend_s
        if delay <= 0:
            self._enqueue(req)
            return
        self._last_arrival_s = max(self._last_arrival_s, req.arrival_s + delay)
        asyncio.get_running_loop().call_later(delay / self.config.time_scale, self._enqueue, req)

    def _enqueue(self, req: Request) -> None:
        if req.finished:  # aborted while still in the frontend
            return
        self.scheduler.add(req)
        self._wakeup.set()

    def abort(self, req: Request) -> None:
        """The client went away: free the request now and count it as aborted."""
        if self.scheduler.abort(req, self.clock.now()):
            self._record(0)

    def kv_transfer_params(self, req: Request) -> dict[str, Any]:
        """What a prefill leg returns for its decode leg (vLLM NixlConnector.request_finished)."""
        extra = self.config.kv_transfer or {}
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(req.blocks)],
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": self.advertised_host,
            "remote_port": self.advertised_port,
            "remote_num_tokens": req.num_prompt,
            "remote_blocks_expiry_time": (req.finished_s or 0.0) + self.config.kv_lease_s,
            "tp_size": self.preset.tp,
            "dcp_size": 1,
            "pp_size": 1,
            "transfer_mode": "read",
            "kv_role": extra.get("kv_role", "kv_both"),
        }

    def release_pin(self, remote_request_id: str, engine_id: str | None) -> Request | None:
        """Serve a decode instance's pull: the pinned request, now released, or None."""
        if engine_id not in (None, self.config.engine_id):
            return None
        req = self.scheduler.release_pin(remote_request_id, self.clock.now())
        if req is not None:
            self._flush_events()
        return req

    def reset_prefix_cache(self) -> bool:
        ok = self.kv.reset_prefix_cache()
        self._flush_events()
        return ok

    # --- sleep mode (SleepMode drives these) ---------------------------------------------------

    def abort_all(self, pulling_only: bool = False) -> int:
        """Abort every request in the engine (or only the PD decode legs waiting for their KV) and
        tell their handlers; returns how many."""
        s = self.scheduler
        victims = list(s.pulling) if pulling_only else [*s.running, *s.waiting, *s.pulling]
        now = self.clock.now()
        for req in victims:
            s.abort(req, now)
        self._record(0)
        for req in victims:
            if req.notify is not None:
                req.notify()
        return len(victims)

    async def wait_drained(self) -> None:
        """Return once no request is running, queued or fetching KV."""
        s = self.scheduler
        while s.running or s.waiting or s.pulling or s.pulls_done:
            self._drained.clear()
            self._wakeup.set()
            await self._drained.wait()

    def discard_kv(self) -> bool:
        """Drop the whole KV cache as sleep does: running requests go back to the queue to be
        recomputed, PD pins are released, every cached block is forgotten (AllBlocksCleared)."""
        self.scheduler.requeue_running()
        self.scheduler.drop_pins()
        self._record(0)
        return self.reset_prefix_cache()

    def resume(self) -> None:
        self.paused = False
        self._wakeup.set()

    # --- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        scheduler = self.scheduler
        clock = self.clock
        step_time = self.step_time
        pool = self.kv.pool
        record_step = self.metrics.record_step
        monotonic = time.monotonic
        # Requests changed by steps whose handlers have not been told yet (insertion-ordered set).
        pending: dict[Request, None] = {}
        burst_end = 0.0
        while True:
            now = clock.next_start()
            if clock.idle:
                now = max(now, self._last_arrival_s)  # woken by an arrival: start at it
            has_work = not self.paused and (scheduler.running or scheduler.waiting or scheduler.pulls_done)
            step = scheduler.schedule(now) if has_work else None
            prefills = step.prefills if step is not None else None
            decodes = step.decodes if step is not None else None
            if step is not None and not prefills and not decodes:
                for req in step.started_pulls:
                    self._start_pull(req, now)
                if step.preempted or step.started_pulls:
                    self._notify(pending)
                    await asyncio.sleep(0)  # admission resumes on the next pass
                    continue
            if not prefills and not decodes:
                self._notify(pending)
                scheduler.expire_pins(clock.now())
                self._flush_events()
                landing = scheduler.next_pull_s()
                if landing is not None and not self._http_pulls and landing - now < 1.0:
                    # A transfer lands shortly: wait for it as an empty step, so it lands on time.
                    clock.begin_step(max(0.0, landing - now), start_s=now)
                    await clock.sleep_step()
                    continue
                clock.go_idle()
                self._drained.set()
                await self._idle_wait()
                continue
            assert step is not None and decodes is not None
            for req in step.started_pulls:
                self._start_pull(req, now)
            num_decodes = len(decodes)
            step_tokens = num_decodes
            if prefills:
                chunks = [(n, ctx) for _, n, ctx in prefills]
                step_tokens += sum([n for n, _ in chunks])
            else:
                chunks = []
            duration = step_time(chunks, num_decodes, step.decode_context_sum)
            if self.lora is not None:  # adapter loads and the batched LoRA kernels (sim/lora.py)
                duration += self.lora.step_cost_s(batch_adapters(prefills or (), decodes))
            _start, end = clock.begin_step(duration, start_s=now)
            delay = clock.step_delay()
            if delay > MIN_SLEEP_S:
                self._notify(pending)
                await asyncio.sleep(delay)
                burst_end = monotonic() + BURST_S
            elif monotonic() >= burst_end:
                self._notify(pending)
                await asyncio.sleep(0)
                burst_end = monotonic() + BURST_S
            # else: behind real time, this step is overdue already: end it now, tell its requests
            # together with the next ones (one write per stream for several steps' tokens).
            changed = scheduler.complete_step(step, end)
            self.steps += 1
            stats = scheduler.stats
            record_step(stats, step_tokens)
            stats.clear()
            if pool.events:
                self._flush_events()
            for req in changed:
                if req.num_output > 1:
                    pending[req] = None
                elif req.notify is not None:  # a first token (or an embedding) goes out at once: TTFT
                    req.notify()

    @staticmethod
    def _notify(pending: dict[Request, None]) -> None:
        """Wake (or write for) each request that steps changed since the last call."""
        if not pending:
            return
        for req in pending:
            notify = req.notify
            if notify is not None:
                notify()
        pending.clear()

    async def _idle_wait(self) -> None:
        self._wakeup.clear()
        timers = [t for t in (self.scheduler.next_pull_s(), self._next_pin_expiry()) if t is not None]
        timeout = self.clock.real_delay(min(timers)) if timers else None
        with contextlib.suppress(TimeoutError):  # asyncio.timeout: 3.11's wait_for can swallow a cancel
            async with asyncio.timeout(timeout):
                await self._wakeup.wait()

    def _next_pin_expiry(self) -> float | None:
        return min((expiry for _, expiry in self.scheduler.pinned.values()), default=None)

    def _record(self, step_tokens: int) -> None:
        """Fold the scheduler's counts since the last call into the metrics."""
        stats = self.scheduler.stats
        self.metrics.record_step(stats, step_tokens)
        stats.clear()

    def _flush_events(self) -> None:
        events = self.kv.pool.drain_events()
        if self.store is not None:  # what the step computed goes to the shared store, as LMCache writes it
            for event in events:
                if event.kind == "stored" and event.medium == "GPU":
                    self.store.put(event.block_hashes)
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _offload_traffic(self) -> tuple[float, float, float, float]:
        """(bytes to DRAM, bytes from DRAM, seconds to, seconds from) since start, for the
        `vllm:kv_offload_total_*` counters (offloads overlap the steps; their time is what the copy takes)."""
        offload = self.kv.offload
        if offload is None:
            return (0.0, 0.0, 0.0, 0.0)
        stats, per_block = offload.stats, offload.bytes_per_block
        out_bytes, in_bytes = stats.offloaded_blocks * per_block, stats.loaded_blocks * per_block
        return (float(out_bytes), float(in_bytes), out_bytes / offload.bandwidth, in_bytes / offload.bandwidth)

    def _state(self) -> tuple[int, int, float]:
        """(running, waiting, KV usage) as the gauges report them, read when /metrics is scraped."""
        s = self.scheduler
        return len(s.running), s.num_waiting, self.kv.usage

    # --- PD pulls --------------------------------------------------------------------------------

    def _start_pull(self, req: Request, now_s: float) -> None:
        self._http_pulls += 1  # counted now: the loop must not wait for a landing it cannot know
        task = asyncio.get_running_loop().create_task(self._pull(req, now_s))
        self._pull_tasks.add(task)
        task.add_done_callback(self._pull_tasks.discard)

    async def _pull(self, req: Request, started_s: float) -> None:
        params = req.remote_prefill or {}
        try:
            tokens, remote = await self._fetch_remote_kv(params)
        finally:
            self._http_pulls -= 1  # the clock stays frozen until the loop starts the next step
        ok = tokens > 0 and req.status is Status.PULLING
        config = self.config
        link = link_class(config.topology, remote) if config.kv_link_bandwidth else None
        self.last_pull_link = link
        bandwidth = (
            config.kv_link_bandwidth.get(link, config.kv_transfer_bandwidth) if link else config.kv_transfer_bandwidth
        )
        transfer_s = roofline.kv_transfer_time_s(self.preset, min(tokens, req.num_prompt), bandwidth) if ok else 0.0
        done_s = started_s + transfer_s if ok else self.clock.now()
        req.kv_pull_s = done_s - started_s
        self.scheduler.finish_pull(req, done_s, ok)
        self._wakeup.set()

    async def _fetch_remote_kv(self, params: dict[str, Any]) -> tuple[int, Topology]:
        """(tokens the prefill engine holds for the request, that engine's topology labels)."""
        host, port = params.get("remote_host"), params.get("remote_port")
        if not host or not port or not params.get("remote_request_id"):
            return 0, UNKNOWN
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        url = f"http://{host}:{port}/internal/kv_pull"
        body = {
            "remote_request_id": params["remote_request_id"],
            "remote_engine_id": params.get("remote_engine_id"),
            "remote_block_ids": params.get("remote_block_ids"),
        }
        try:
            async with self._session.post(url, json=body) as resp:
                if resp.status != 200:
                    return 0, UNKNOWN
                data = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.info("kv pull from %s failed (%s); recomputing", url, exc)
            return 0, UNKNOWN
        labels = data.get("topology") if isinstance(data.get("topology"), dict) else {}
        remote = Topology(**{k: str(v) for k, v in labels.items() if k in ("node", "rack", "zone") and v})
        return int(data.get("num_tokens", 0)), remote


# --- the clock ------------------------------------------------------------------------------------

# Real seconds the engine may fall behind its schedule before the clock forgives the lag.
MAX_LAG_S = 0.05
# Shorter waits are not slept (timers have ~1 ms granularity): the step ends at once.
MIN_SLEEP_S = 0.0005


class SimClock:
    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.scale = time_scale
        self._sim_anchor = 0.0
        self._real_anchor = time.monotonic()
        self._step_start = 0.0
        self._step_end: float | None = None  # None while idle
        self._last_end = 0.0

    @property
    def idle(self) -> bool:
        return self._step_end is None

    def now(self) -> float:
        """Simulated now: during a step, clamped to the step's interval; idle, the scaled wall clock."""
        mapped = self._sim_anchor + (time.monotonic() - self._real_anchor) * self.scale
        if self._step_end is None:
            return max(mapped, self._last_end)
        return min(max(mapped, self._step_start), self._step_end)

    def next_start(self) -> float:
        """Earliest start of the next step: the last step's end (busy or idle)."""
        return self._last_end

    def real_delay(self, sim_s: float) -> float:
        """Real seconds from now until simulated time `sim_s` (idle mapping; >= 0)."""
        return max(0.0, (sim_s - self.now()) / self.scale)

    def begin_step(self, duration_s: float, start_s: float | None = None) -> tuple[float, float]:
        """Start a step of `duration_s` simulated seconds at `start_s` (default: the last step's end,
        or now when idle); returns its (start, end)."""
        if self._step_end is None:
            start = self.now() if start_s is None else max(start_s, self._last_end)
            self._sim_anchor, self._real_anchor = start, time.monotonic()
        else:
            start = self._step_end if start_s is None else max(start_s, self._step_end)
            lag = time.monotonic() - self._real_target(start)
            if lag > MAX_LAG_S:
                self._sim_anchor, self._real_anchor = start, time.monotonic()
        self._step_start, self._step_end = start, start + duration_s
        self._last_end = start + duration_s
        return start, start + duration_s

    def step_delay(self) -> float:
        """Real seconds until the current step's end is due (<= 0: overdue)."""
        assert self._step_end is not None
        return self._real_target(self._step_end) - time.monotonic()

    async def sleep_step(self) -> None:
        """Sleep (really) until the current step's end is due."""
        delay = self.step_delay()
        # Timer granularity is ~1 ms: sleep only what matters; tiny steps just yield.
        await asyncio.sleep(delay if delay > MIN_SLEEP_S else 0)

    def go_idle(self) -> None:
        """No more work: from here simulated time follows the wall clock from the last step's end."""
        if self._step_end is None:
            return
        self._sim_anchor, self._real_anchor = self._step_end, time.monotonic()
        self._step_end = None

    def _real_target(self, sim_s: float) -> float:
        return self._real_anchor + (sim_s - self._sim_anchor) / self.scale


# --- sleep mode -----------------------------------------------------------------------------------


TAGS: Final = ("weights", "kv_cache")
MODES: Final = ("abort", "wait", "keep")
# Routes that run the model: refused while the weights are away.
PROTECTED_PATHS: Final = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages"}
)
SLEEPING_MESSAGE: Final = "Model is currently in sleep mode. Please wake it up first with a POST request to /wake_up"


class SleepMode:
    """One engine's sleep state and its transitions (one at a time)."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.level = 0  # the level it went to sleep at; 0 while awake
        self.sleeping_tags: set[str] = set()
        self.pausing = False  # between a /sleep call and the engine being asleep
        self._lock = asyncio.Lock()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    @property
    def accepting(self) -> bool:
        """Whether requests that need the weights may enter."""
        return not self.sleeping_tags and not self.pausing

    def state_level(self) -> int:
        """0 awake, else the level slept at (the `vllm:engine_sleep_state` series that is 1)."""
        return self.level if self.sleeping_tags else 0

    async def sleep(self, level: int, mode: str) -> None:
        engine = self.engine
        duration = 0.0
        async with self._lock:
            if self.sleeping_tags:
                log.warning("the engine is already sleeping")
                return
            self.pausing = True
            try:
                if mode == "abort":
                    engine.abort_all()
                elif mode == "wait":
                    await engine.wait_drained()
                else:  # keep: queued and running requests stay, to be recomputed after the wake-up
                    engine.paused = True
                    engine.abort_all(pulling_only=True)
                engine.paused = True
                if not engine.discard_kv():
                    log.warning("KV blocks still in use while going to sleep")
                duration = roofline.sleep_s(engine.preset, level)
                await self._take(duration)
                engine.metrics.observe_sleep_operation("sleep", duration)
                self.level = level
                self.sleeping_tags = set(TAGS)
            except BaseException:
                engine.resume()
                raise
            finally:
                self.pausing = False
        log.info("engine asleep at level %d (%.2f s simulated)", level, duration)

    async def wake_up(self, tags: list[str] | None) -> None:
        engine = self.engine
        async with self._lock:
            if not self.sleeping_tags:
                log.warning("the engine is not sleeping")
                return
            wanted = set(tags) if tags else set(self.sleeping_tags)
            wanted &= self.sleeping_tags
            duration = 0.0
            if "weights" in wanted:
                duration = roofline.wake_s(engine.preset, self.level, engine.config.load_bandwidth)
            await self._take(duration)
            engine.metrics.observe_sleep_operation("wake", duration)
            self.sleeping_tags -= wanted
            if not self.sleeping_tags:
                self.level = 0
                engine.resume()
        log.info("woke %s (%.2f s simulated)", ", ".join(sorted(wanted)) or "nothing", duration)

    async def _take(self, simulated_s: float) -> None:
        if simulated_s > 0:
            await asyncio.sleep(simulated_s / self.engine.config.time_scale)


def routes_enabled(engine: SimEngine) -> bool:
    return engine.config.enable_sleep_mode and engine.config.server_dev_mode


def install(app: web.Application, engine: SimEngine) -> None:
    """Add the sleep routes and the 503 guard to the engine's app, when vLLM would have them."""
    if not routes_enabled(engine):
        return
    state = engine.sleep_mode

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not state.accepting and request.path in PROTECTED_PATHS:
            return _error(503, "ModelSleepingError", SLEEPING_MESSAGE)
        return await handler(request)

    async def sleep(request: web.Request) -> web.StreamResponse:
        level_text = request.query.get("level", "1")
        mode = request.query.get("mode", "abort")
        if not level_text.isdigit() or int(level_text) not in roofline.SLEEP_LEVELS:
            return _error(400, "BadRequestError", f"level must be one of {roofline.SLEEP_LEVELS}")
        if mode not in MODES:
            return _error(400, "BadRequestError", f"mode must be one of {MODES}")
        await state.sleep(int(level_text), mode)
        return web.Response(status=200)

    async def wake_up(request: web.Request) -> web.StreamResponse:
        tags = request.query.getall("tags", [])
        unknown = [tag for tag in tags if tag not in TAGS]
        if unknown:
            return _error(400, "BadRequestError", f"unknown tags {unknown}; known: {list(TAGS)}")
        await state.wake_up(tags or None)
        return web.Response(status=200)

    async def is_sleeping(_request: web.Request) -> web.StreamResponse:
        return web.Response(body=orjson.dumps({"is_sleeping": state.is_sleeping}), content_type="application/json")

    app.middlewares.append(guard)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)


def _error(status: int, kind: str, message: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")

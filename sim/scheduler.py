"""vLLM V1's scheduling step, without the GPU: who runs in the next step, and with how many tokens;
and the `Request` it schedules.

Each call to `Scheduler.schedule` builds one step under a token budget (`max_num_batched_tokens`):

1. Running requests first, in admission order, each with all its uncomputed tokens (one for a
   decode; the rest of a chunked prompt) up to the remaining budget. When the KV pool has no block
   for one, the most recently admitted running request is preempted by recompute (its blocks freed,
   back to the head of the queue) until it fits, or it is itself the one preempted.
2. If nobody was preempted, waiting requests in FIFO order while there is budget and fewer than
   `max_num_seqs` run: each first reuses its longest cached prefix, then gets a (possibly partial,
   i.e. chunked) prefill of the rest; the first that does not fit in the pool stops admission.

`complete_step` then reveals one token for every request whose scheduled tokens caught up with its
known tokens, finishes those that reached their planned length, and frees (or, for a PD prefill leg,
pins) their blocks. Decode legs of PD wait in `pulling` while their KV is fetched, and so do
requests whose prefix continues in the host-DRAM tier (`HostOffload`, kv_cache.py) while it is loaded.

Plain Python over ints and lists: it runs once per simulated step for every engine of a fleet.

The request
-----------
`Request`, one request inside the simulated engine: its tokens, its place in the schedule, its timestamps.

All times are simulated seconds on the engine's clock. The output is planned at admission (ids and
length are deterministic), and revealed one token per step; `num_output` says how much is known.
"""

from __future__ import annotations

import contextlib
import enum
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sim.kv_cache import KVCacheManager
from sim.lora import LoraSlots


@dataclass(slots=True)
class Step:
    """The work of one step. prefills: (request, new tokens, context before); decodes: (request,
    context before), whose contexts add up to `decode_context_sum`."""

    prefills: list[tuple[Request, int, int]] = field(default_factory=list)
    decodes: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    started_pulls: list[Request] = field(default_factory=list)
    decode_context_sum: int = 0

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.prefills) + len(self.decodes)


@dataclass(slots=True)
class StepStats:
    """Counts and latencies a step produced, drained into the Prometheus metrics.

    Inter-token latencies are counted by value: the requests that decode in one step mostly share
    the previous step's end, so a step yields one or two distinct values however large its batch.
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    ttfts: list[float] = field(default_factory=list)
    itl_counts: dict[float, int] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)

    @property
    def itls(self) -> list[float]:
        """Every inter-token latency, one per token (for inspection; the metrics use the counts)."""
        return [value for value, count in self.itl_counts.items() for _ in range(count)]

    def clear(self) -> None:
        self.prompt_tokens = self.generation_tokens = self.preemptions = 0
        self.prefix_queries = self.prefix_hits = 0
        if self.ttfts:
            self.ttfts = []
        if self.itl_counts:
            self.itl_counts = {}
        if self.finished:
            self.finished = []


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        pin_lease_s: float = 30.0,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pin_lease_s = pin_lease_s
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pulling: list[Request] = []
        self.pulls_done: list[tuple[float, Request, bool]] = []
        self.pinned: dict[str, tuple[Request, float]] = {}
        self.stats = StepStats()
        self.lora: LoraSlots | None = None  # --enable-lora: at most max_loras adapters per batch (sim/lora.py)

    # --- queue changes ---------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_waiting(self) -> int:
        """Waiting as vLLM reports it: queued plus waiting for remote KV."""
        return len(self.waiting) + len(self.pulling)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def abort(self, req: Request, now_s: float) -> bool:
        """Drop a request wherever it is and free its blocks at once. False if already finished."""
        if req.finished:
            return False
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.PULLING:
            self.pulling.remove(req)
        else:
            with contextlib.suppress(ValueError):  # not queued yet (still arriving)
                self.waiting.remove(req)
        self.kv.free(req)
        self._finish(req, "abort", now_s, release=False)
        return True

    def requeue_running(self) -> int:
        """Preempt every running request by recompute (the KV cache is going away), keeping their
        order at the head of the queue; returns how many."""
        running, self.running = self.running, []
        step = Step()
        for req in reversed(running):
            self._preempt(req, step)
        return len(running)

    def finish_pull(self, req: Request, done_s: float, ok: bool) -> None:
        """Record that a PD decode leg's KV transfer ends at `done_s` (takes effect at that step)."""
        self.pulls_done.append((done_s, req, ok))

    # --- the step --------------------------------------------------------------------------------

    def schedule(self, now_s: float) -> Step:
        step = Step()
        self._land_pulls(now_s)
        self.expire_pins(now_s)
        kv = self.kv
        budget = self.max_num_batched_tokens
        running = self.running

        allocate = kv.allocate_slots
        bs = kv.block_size
        caching = kv.enable_caching
        decodes = step.decodes
        context_sum = 0
        index = 0
        while index < len(running) and budget > 0:
            req = running[index]
            context = req.num_computed
            num_prompt = req.num_prompt
            num_new = num_prompt + req.num_output - context
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                index += 1
                continue
            # one more token in a block it holds, filling none, needs no allocation (allocate_slots
            # would do nothing); anything else allocates, preempting from the back until it fits
            in_held_block = (
                num_new == 1
                and context < len(req.blocks) * bs
                and (not caching or (context + 1) // bs <= req.num_stored_blocks)
            )
            if not in_held_block:
                scheduled = True
                while not allocate(req, num_new):
                    victim = running.pop()
                    self._preempt(victim, step)
                    if victim is req:
                        scheduled = False
                        break
                if not scheduled:
                    break
            if num_new == 1 and context >= num_prompt:  # _add_work, inlined for the common case
                decodes.append((req, context))
                context_sum += context
                req.num_computed = context + 1
            else:
                step.prefills.append((req, num_new, context))
                req.num_computed = context + num_new
            budget -= num_new
            index += 1
        step.decode_context_sum += context_sum

        if not step.preempted:
            budget = self._admit(step, budget, now_s)
        return step

    def _admit(self, step: Step, budget: int, now_s: float) -> int:
        kv = self.kv
        bs = kv.block_size
        waiting = self.waiting
        lora = self.lora
        batch_loras = {r.lora_name for r in self.running if r.lora_name} if lora is not None else set()
        skipped: list[Request] = []  # waiting on an adapter slot: stay queued, in order, for later steps
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = waiting[0]
            if lora is not None and req.lora_name is not None:
                if not lora.admissible(req.lora_name, batch_loras):
                    skipped.append(waiting.popleft())
                    continue
                batch_loras.add(req.lora_name)
            fresh = req.num_computed == 0
            hits = kv.computed_blocks(req) if fresh else []
            hit_tokens = len(hits) * bs
            if req.remote_prefill is not None and req.status is Status.WAITING and fresh:
                # PD decode leg: room for the whole prompt, filled by the transfer, not by compute.
                if not kv.allocate_slots(req, req.num_prompt - hit_tokens, hits, store=False):
                    break
                waiting.popleft()
                self._count_prefix_query(req, hit_tokens)
                req.num_computed = hit_tokens
                req.status = Status.PULLING
                self.pulling.append(req)
                step.started_pulls.append(req)
                continue
            offload = kv.offload
            if fresh and offload is not None:  # the prefix goes on in host DRAM: load it, don't compute it
                loaded = offload.match(req, len(hits), (req.num_tokens - 1) // bs)
                if loaded:
                    if not kv.allocate_slots(req, loaded * bs, hits, store=False):
                        break
                    waiting.popleft()
                    self._count_prefix_query(req, hit_tokens + loaded * bs)
                    req.num_computed = hit_tokens
                    req.status = Status.PULLING
                    self.pulling.append(req)
                    self.pulls_done.append((offload.start_load(req, loaded, bs, now_s), req, True))
                    continue
            num_new = min(req.num_tokens - req.num_computed - hit_tokens, budget)
            if not kv.allocate_slots(req, num_new, hits):
                if offload is not None and self._release_loaded(req):
                    continue  # blocks of loaded requests queued behind it were in the way: retry
                break
            waiting.popleft()
            if req.first_scheduled_s is None:
                req.first_scheduled_s = now_s
                req.num_cached_tokens = req.num_computed + hit_tokens
                self._count_prefix_query(req, hit_tokens)
            req.num_computed += hit_tokens
            req.status = Status.RUNNING
            self.running.append(req)
            self._add_work(step, req, num_new)
            budget -= num_new
        if skipped:
            waiting.extendleft(reversed(skipped))
        return budget

    def _release_loaded(self, head: Request) -> bool:
        """Free the blocks of queued requests whose KV was loaded from host DRAM (they keep their
        hashes, so those requests find them again), when the queue's head cannot be allocated: a
        request preempted ahead of them would otherwise wait for blocks nobody runs to free."""
        released = False
        for req in self.waiting:
            if req is not head and req.blocks and req.remote_prefill is None and req.first_scheduled_s is None:
                self.kv.free(req)
                req.num_computed = 0
                released = True
        return released

    def _count_prefix_query(self, req: Request, hit_tokens: int) -> None:
        """vLLM counts a request's prefix lookup once, in tokens (re-admissions after preemption and
        the transfer-completed re-admission of a PD decode leg are not new queries)."""
        if not req.prefix_counted:
            req.prefix_counted = True
            self.stats.prefix_queries += req.num_prompt
            self.stats.prefix_hits += hit_tokens

    def _add_work(self, step: Step, req: Request, num_new: int) -> None:
        context = req.num_computed
        if num_new == 1 and context >= req.num_prompt:
            step.decodes.append((req, context))
            step.decode_context_sum += context
        else:
            step.prefills.append((req, num_new, context))
        req.num_computed = context + num_new

    def _preempt(self, req: Request, step: Step) -> None:
        self.kv.free(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req)
        self.stats.preemptions += 1

    def complete_step(self, step: Step, end_s: float) -> list[Request]:
        """Reveal the tokens the step produced; returns the requests that changed."""
        changed: list[Request] = []
        stats = self.stats
        any_finished = False
        for req, _n, _ctx in step.prefills:
            if self._advance(req, end_s, stats):
                changed.append(req)
                any_finished |= req.finished
        # Decodes: _advance inlined for a request that already has its first token.
        running_status = Status.RUNNING
        itl_counts = stats.itl_counts
        generated = 0
        for req, _ctx in step.decodes:
            last = req.last_token_s
            if req.status is not running_status or last is None or req.num_computed < req.num_prompt + req.num_output:
                if self._advance(req, end_s, stats):  # not running any more, or an unusual state
                    changed.append(req)
                    any_finished |= req.finished
                continue
            num_output = req.num_output + 1
            req.num_output = num_output
            generated += 1
            itl = end_s - last
            itl_counts[itl] = itl_counts.get(itl, 0) + 1
            req.last_token_s = end_s
            changed.append(req)
            if num_output >= len(req.output_ids):
                self._end(req, end_s)
                any_finished = True
        stats.generation_tokens += generated
        if any_finished:
            self.running = [r for r in self.running if not r.finished]
        return changed

    def _advance(self, req: Request, end_s: float, stats: StepStats) -> bool:
        if req.finished or req.status is not Status.RUNNING or req.num_computed < req.num_tokens:
            return False  # aborted or preempted meanwhile, or a prompt chunk that produced nothing
        if req.pooling:  # an embedding: its prompt is computed, the pooled output is ready
            req.first_token_s = req.last_token_s = end_s
            stats.ttfts.append(end_s - req.arrival_s)
            stats.prompt_tokens += req.num_prompt
            self._finish(req, "stop", end_s, release=True)
            return True
        req.num_output += 1
        stats.generation_tokens += 1
        if req.first_token_s is None:
            req.first_token_s = end_s
            stats.ttfts.append(end_s - req.arrival_s)
            stats.prompt_tokens += req.num_prompt
        elif req.last_token_s is not None:
            itl = end_s - req.last_token_s
            stats.itl_counts[itl] = stats.itl_counts.get(itl, 0) + 1
        req.last_token_s = end_s
        if req.num_output >= len(req.output_ids):
            self._end(req, end_s)
        return True

    def _end(self, req: Request, end_s: float) -> None:
        """The request produced its planned output: finish it (a PD prefill leg keeps its blocks)."""
        if req.remote_decode:
            self._finish(req, req.stop_reason_at_end, end_s, release=False)
            self.pinned[req.request_id] = (req, end_s + self.pin_lease_s)
        else:
            self._finish(req, req.stop_reason_at_end, end_s, release=True)

    def _finish(self, req: Request, reason: str, now_s: float, release: bool) -> None:
        if release:
            self.kv.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_s = now_s
        self.stats.finished.append(req)

    def drain_stats(self) -> StepStats:
        stats, self.stats = self.stats, StepStats()
        return stats

    # --- PD --------------------------------------------------------------------------------------

    def _land_pulls(self, now_s: float) -> None:
        if not self.pulls_done:
            return
        pending: list[tuple[float, Request, bool]] = []
        for done_s, req, ok in self.pulls_done:
            if done_s > now_s:
                pending.append((done_s, req, ok))
                continue
            loaded = self.kv.offload.finish_load(req) if self.kv.offload is not None else None
            if req.finished:
                continue
            self.pulling.remove(req)
            req.status = Status.WAITING
            if loaded is not None:  # back from host DRAM: computed, and cached in HBM again
                req.num_computed += loaded
                self.kv.store_full_blocks(req, req.num_computed)
            elif ok:
                req.num_external_tokens = req.num_prompt - 1 - req.num_computed
                req.num_computed = req.num_prompt - 1  # the last prompt token is recomputed
            else:  # kv_load_failure_policy "recompute": forget the transfer, prefill locally
                self.kv.free(req)
                req.num_computed = 0
                req.remote_prefill = None
            self.waiting.appendleft(req)
        self.pulls_done = pending

    def next_pull_s(self) -> float | None:
        return min((done for done, _, _ in self.pulls_done), default=None)

    def release_pin(self, request_id: str, now_s: float) -> Request | None:
        """Hand a prefill leg's KV to its decode leg: free the pinned blocks (they stay cached)."""
        self.expire_pins(now_s)
        entry = self.pinned.pop(request_id, None)
        if entry is None:
            return None
        self.kv.free(entry[0])
        return entry[0]

    def drop_pins(self) -> int:
        """Free every pinned prefill leg's blocks (their decode legs will recompute)."""
        pinned, self.pinned = self.pinned, {}
        for req, _ in pinned.values():
            self.kv.free(req)
        return len(pinned)

    def expire_pins(self, now_s: float) -> int:
        if not self.pinned:
            return 0
        expired = [rid for rid, (_, expiry) in self.pinned.items() if expiry <= now_s]
        for rid in expired:
            req, _ = self.pinned.pop(rid)
            self.kv.free(req)
        return len(expired)


# --- the request ----------------------------------------------------------------------------------

_IDS = random.Random()  # seeded from os.urandom once; a uuid4 per request costs a getrandom call


def new_id() -> str:
    """32 random hex digits, like ``uuid.uuid4().hex`` (without the syscall)."""
    return f"{_IDS.getrandbits(128):032x}"


class Status(enum.Enum):
    WAITING = "waiting"
    PULLING = "pulling"  # decode leg of PD: waiting for its KV to arrive from the prefill instance
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # planned output; finishing when num_output reaches len(output_ids)
    stop_reason_at_end: str  # "length" (max_tokens or context) or "stop" (the model's own end)
    arrival_s: float
    max_tokens: int
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (sim/lora.py); salts its block hashes
    remote_prefill: dict[str, Any] | None = None  # kv_transfer_params of a decode leg
    remote_decode: bool = False  # a prefill leg: keep the blocks for the decode instance

    status: Status = Status.WAITING
    num_output: int = 0
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_stored_blocks: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from cache at first scheduling
    num_external_tokens: int = 0  # of which pulled from a prefill instance
    num_preemptions: int = 0
    prefix_counted: bool = False
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: str | None = None
    kv_pull_s: float = 0.0
    pooling: bool = False  # an embedding: finishes when its prompt is computed, without output
    # Called by the engine after a step that revealed a token of this request or finished it.
    notify: Callable[[], None] | None = None
    num_prompt: int = field(init=False)  # len(prompt_ids), read on every step

    def __post_init__(self) -> None:
        self.num_prompt = len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + self.num_output

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def timings(self) -> dict[str, float | int]:
        """The per-request metrics object (simulated seconds) returned with the response."""
        arrival = self.arrival_s
        scheduled = self.first_scheduled_s if self.first_scheduled_s is not None else arrival
        first = self.first_token_s if self.first_token_s is not None else scheduled
        last = self.last_token_s if self.last_token_s is not None else first
        end = self.finished_s if self.finished_s is not None else last
        tpot = (last - first) / (self.num_output - 1) if self.num_output > 1 else 0.0
        return {
            "arrival_s": round(arrival, 9),
            "queue_s": round(scheduled - arrival, 9),
            "ttft_s": round(first - arrival, 9),
            "tpot_s": round(tpot, 9),
            "prefill_s": round(first - scheduled, 9),
            "decode_s": round(last - first, 9),
            "e2e_s": round(end - arrival, 9),
            "kv_pull_s": round(self.kv_pull_s, 9),
            "prompt_tokens": self.num_prompt,
            "completion_tokens": self.num_output,
            "cached_tokens": self.num_cached_tokens or 0,
            "preemptions": self.num_preemptions,
        }

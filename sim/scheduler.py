"""vLLM V1's scheduling step, without the GPU: who runs in the next step, and with how many tokens.

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
requests whose prefix continues in the host-DRAM tier (`kv_offload.py`) while it is loaded.

Plain Python over ints and lists: it runs once per simulated step for every engine of a fleet.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from sim.kv_cache import KVCacheManager
from sim.lora import LoraSlots
from sim.request import Request, Status


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

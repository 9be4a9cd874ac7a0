"""Analytic TTFT/TPOT prior from the pool's model and hardware, used before a model exists.

The step-time physics is the roofline the simulated engine runs on (`backends.perf.roofline.step_cost`),
over the same presets, so recalibrating the simulator moves this prior too:

    step_s = max(compute_s, memory_s) + comm_s + overhead_s
    compute_s = k_token·tokens + k_sampled·sequences + k_attention·attention_pairs
    memory_s  = weights_s + k_kv·(kv_read_tokens + tokens)
    comm_s    = comm_base_s + comm_token_s·tokens          (TP > 1)
    overhead_s = step_overhead_s + prefill_overhead_s·[step carries prefill] + sequence_overhead_s·sequences

`Roofline.from_preset` recovers these coefficients by probing `step_cost` at a few points (each part
is affine in the step's aggregates), so the prior uses exactly the sim's quantities as plain float
arithmetic (a few microseconds per candidate) instead of building step descriptions for `step_cost`.

Per candidate, with the engine's limits S = max_num_seqs and B = max_num_batched_tokens (vLLM V1:
running decodes are scheduled first, then waiting prefills FCFS in chunks of the remaining budget):

    D        = decoding batch now = min(S, max(running, inflight_requests - waiting))
    work     = inflight_prefill_tokens + uncached   (prompt tokens prefilled before its first token)
    steps    = ceil(work / max(B - D, 64))
    steady(n)= mean step of n decodes while prompts arrive at the endpoint's recent prefill rate
               (fluid fixed point, see `_steady_step_s`; a plain decode step when the rate is 0)
    TTFT     = frontend                                                    API server, both ways
             + steps · step(work/steps prefill tokens + D decodes)          chunked prefill
             + max(0, steady(D) - since_last_token)  (else steady(D)/2)    the step in progress
             + excess · output / (2·D) · step(D decodes)                    waiting for a batch slot
               where excess = max(0, D + waiting + 1 - S)
    TPOT     = steady(min(D + 1, S)) over their context + own input + output/2

It ignores the randomness of future arrivals, preemption and KV exhaustion: the trained model
learns those as a correction (a log-ratio over this prior, see model.py).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import astuple, dataclass
from typing import NamedTuple

from backends.config import PoolConfig
from backends.perf.capacity import batch_defaults
from backends.perf.presets import DEFAULT_PRESET, Preset, resolve_preset
from backends.perf.roofline import step_cost
from predictor.config import PriorSettings

PRIOR_VERSION = 2  # bump when the formula changes: saved models learnt a correction to the old one
_PROBE_CONTEXT = 1024
_MIN_PREFILL_CHUNK = 64
_FIXED_POINT_ITERATIONS = 4


@dataclass(frozen=True, slots=True)
class Roofline:
    """The sim's step-time roofline as coefficients (seconds per unit; see the module docstring)."""

    k_token_s: float
    k_sampled_s: float
    k_attention_s: float
    weights_s: float
    k_kv_s: float
    comm_base_s: float
    comm_token_s: float
    step_overhead_s: float
    prefill_overhead_s: float
    frontend_s: float = 0.0  # per request, before the first token (Efficiency.frontend_s)
    sequence_overhead_s: float = 0.0  # per scheduled sequence per step (Efficiency.sequence_overhead_s)

    @classmethod
    def from_preset(cls, preset: Preset) -> Roofline:
        n = _PROBE_CONTEXT
        # a: one decode at context 0 (tokens 1, sequences 1, pairs 1, kv read 0)
        # b: one decode at context n (tokens 1, sequences 1, pairs n+1, kv read n)
        # c: one prefill of n tokens (tokens n, sequences 1, pairs n(n+1)/2, kv read 0)
        a = step_cost(preset, (), [0])
        b = step_cost(preset, (), [n])
        c = step_cost(preset, [(n, 0)], ())
        k_attention = (b.compute_s - a.compute_s) / n
        pairs_c = n * (n + 1) / 2
        k_token = ((c.compute_s - pairs_c * k_attention) - (a.compute_s - k_attention)) / (n - 1)
        k_sampled = a.compute_s - k_attention - k_token
        k_kv = (b.memory_s - a.memory_s) / n
        comm_token = (c.comm_s - a.comm_s) / (n - 1)
        return cls(
            k_token_s=k_token,
            k_sampled_s=k_sampled,
            k_attention_s=k_attention,
            weights_s=a.memory_s - k_kv,
            k_kv_s=k_kv,
            comm_base_s=a.comm_s - comm_token,
            comm_token_s=comm_token,
            step_overhead_s=a.overhead_s - preset.efficiency.sequence_overhead_s,
            prefill_overhead_s=c.overhead_s - a.overhead_s,
            frontend_s=preset.efficiency.frontend_s,
            sequence_overhead_s=preset.efficiency.sequence_overhead_s,
        )

    def step_s(
        self, tokens: float, sequences: float, attention_pairs: float, kv_read_tokens: float, has_prefill: bool
    ) -> float:
        """Duration of a step with these aggregates (same meaning as in `step_cost`)."""
        compute = self.k_token_s * tokens + self.k_sampled_s * sequences + self.k_attention_s * attention_pairs
        memory = self.weights_s + self.k_kv_s * (kv_read_tokens + tokens)
        roof = compute if compute > memory else memory
        overhead = self.step_overhead_s + self.prefill_overhead_s if has_prefill else self.step_overhead_s
        return roof + self.comm_base_s + self.comm_token_s * tokens + overhead + self.sequence_overhead_s * sequences


class PriorEstimate(NamedTuple):
    """The prior for one candidate, and the intermediate quantities it exposes as features."""

    batch_requests: float
    batch_context_tokens: float
    prefill_steps: float
    ttft_ms: float
    tpot_ms: float


class LatencyPrior:
    """TTFT/TPOT of a request on each candidate endpoint from the roofline (module docstring)."""

    def __init__(
        self,
        roofline: Roofline,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preset_name: str = "",
        time_scale: float = 1.0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.roofline = roofline
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preset_name = preset_name
        self.time_scale = time_scale  # engine seconds per wall second (the simulated engine's --time-scale)

    @property
    def id(self) -> str:
        """Identifies this prior in saved models (a model only fits the prior it was trained over).

        It carries a digest of the roofline's coefficients, so recalibrating the presets
        (`backends/perf/presets.py`) retires models trained over the old physics as a formula change does.
        """
        scale = f"|x{self.time_scale:g}" if self.time_scale != 1.0 else ""
        physics = hashlib.sha256(repr(astuple(self.roofline)).encode()).hexdigest()[:8]
        return (
            f"{self.preset_name}|v{PRIOR_VERSION}|r{physics}|seqs={self.max_num_seqs}"
            f"|tokens={self.max_num_batched_tokens}{scale}"
        )

    @classmethod
    def for_pool(cls, pool: PoolConfig | None, settings: PriorSettings) -> LatencyPrior:
        """The pool's preset (`model@hw`), or the sim's default preset when the pool names none.

        Engine limits: the pool's, else the settings', else vLLM's defaults for the device memory
        (the same `batch_defaults` the simulated engine applies).
        """
        preset_name = (pool.preset if pool is not None else None) or DEFAULT_PRESET
        preset = resolve_preset(preset_name, pool.tensor_parallel if pool is not None else None)
        default_seqs, default_tokens = batch_defaults(preset)
        return cls(
            Roofline.from_preset(preset),
            max_num_seqs=(pool.max_num_seqs if pool else None) or settings.max_num_seqs or default_seqs,
            max_num_batched_tokens=(pool.max_num_batched_tokens if pool else None)
            or settings.max_num_batched_tokens
            or default_tokens,
            preset_name=preset.name,
            time_scale=settings.time_scale,
        )

    def estimate(
        self,
        input_tokens: float,
        cached_tokens: float,
        output_tokens: float,
        running: float,
        waiting: float,
        inflight_requests: float,
        inflight_prefill_tokens: float,
        inflight_decode_tokens: float,
        prefill_rate_tps: float = 0.0,
        since_last_token_ms: float = -1.0,
    ) -> PriorEstimate:
        """The prior for one candidate (plain floats: cheaper than numpy for a handful of candidates).

        Inputs and outputs are wall-clock (ms, tokens/s); the roofline runs in engine time, which a
        simulated engine's `time_scale` compresses.
        """
        scale = self.time_scale
        if scale != 1.0:
            prefill_rate_tps /= scale
            if since_last_token_ms >= 0:
                since_last_token_ms *= scale
        step_s = self.roofline.step_s
        seqs_limit = self.max_num_seqs
        uncached = input_tokens - cached_tokens
        decoding = max(running, inflight_requests - waiting)
        if decoding > seqs_limit:
            decoding = seqs_limit
        # context of the batch already decoding; guess from this request when the gateway knows none
        decode_ctx = inflight_decode_tokens or decoding * (input_tokens + output_tokens / 2)

        work = inflight_prefill_tokens + uncached
        chunk = self.max_num_batched_tokens - decoding
        if chunk < _MIN_PREFILL_CHUNK:
            chunk = _MIN_PREFILL_CHUNK
        steps = math.ceil(work / chunk) or 1
        per_step = work / steps
        # each prompt token attends to everything before it (its total is independent of chunking);
        # a chunk reads the KV of its context before the chunk: on average cached + (uncached - chunk)/2
        prefill_pairs = per_step * (cached_tokens + (uncached + 1) / 2)
        prefill_kv_read = cached_tokens + max(uncached - per_step, 0.0) / 2
        prefill_step = step_s(
            per_step + decoding,
            decoding + 1,
            prefill_pairs + decode_ctx + decoding,
            prefill_kv_read + decode_ctx,
            True,
        )
        ttft_s = self.roofline.frontend_s + steps * prefill_step
        if decoding > 0 or inflight_prefill_tokens > 0:  # arriving mid-step: wait for its end
            step_now = self._steady_step_s(decoding, decode_ctx, prefill_rate_tps, input_tokens)
            if since_last_token_ms >= 0:  # steps run back to back: this one began at the last token
                ttft_s += max(step_now - since_last_token_ms / 1e3, 0.0)
            else:
                ttft_s += 0.5 * step_now
        excess = decoding + waiting + 1 - seqs_limit
        if excess > 0:  # the batch is full: wait for running requests to finish (half their output)
            decode_only = step_s(decoding, decoding, decode_ctx + decoding, decode_ctx, False)
            ttft_s += excess * output_tokens / (2 * max(decoding, 1.0)) * decode_only

        batch = decoding + 1 if decoding < seqs_limit else seqs_limit
        batch_ctx = decode_ctx + input_tokens + output_tokens / 2
        tpot_s = self._steady_step_s(batch, batch_ctx, prefill_rate_tps, input_tokens)
        return PriorEstimate(batch, batch_ctx, float(steps), ttft_s * 1e3 / scale, tpot_s * 1e3 / scale)

    def steady_step_s(self, decodes: float, decode_ctx: float, prefill_rate_tps: float, prompt_tokens: float) -> float:
        """Mean engine step (engine seconds) of `decodes` requests over `decode_ctx` context tokens
        while prompts of `prompt_tokens` arrive at `prefill_rate_tps` (engine time)."""
        return self._steady_step_s(decodes, decode_ctx, prefill_rate_tps, prompt_tokens)

    def _steady_step_s(self, decodes: float, decode_ctx: float, prefill_rate_tps: float, prompt_tokens: float) -> float:
        """Mean step of `decodes` requests while prompts arrive at `prefill_rate_tps` tokens/s.

        Fluid approximation, iterated to its fixed point: a step carries the prompt tokens that
        arrived during the one before (q = rate x step, at most the chunk budget), in whole prompts
        of about `prompt_tokens` (this request's length stands in for the others'); so a share
        min(1, q / prompt) of steps carries a prefill chunk and pays the prefill overhead.
        """
        step_s = self.roofline.step_s
        base = step_s(decodes, decodes, decode_ctx + decodes, decode_ctx, False)
        if prefill_rate_tps <= 0:
            return base
        budget = max(self.max_num_batched_tokens - decodes, _MIN_PREFILL_CHUNK)
        chunk = min(max(prompt_tokens, 1.0), budget)
        context = prompt_tokens / 2
        step = base
        for _ in range(_FIXED_POINT_ITERATIONS):
            tokens = min(prefill_rate_tps * step, budget)
            share = min(1.0, tokens / chunk)
            carried = tokens / share if share > 0 else 0.0
            with_prefill = step_s(
                decodes + carried, decodes + 1, decode_ctx + decodes + carried * context, decode_ctx + context, True
            )
            step = share * with_prefill + (1 - share) * base
        return step

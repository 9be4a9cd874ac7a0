"""Whole benchmark runs replayed through the simulated engine's scheduler, priced by the roofline.

A published serving benchmark (`vllm bench serve`, `vllm bench latency`) reports a run's mean TTFT,
mean TPOT and duration. To compare, the same workload goes through the simulated engine exactly as
`sim` would run it: vLLM V1's scheduler (running requests first, then waiting ones FCFS in
chunks of the remaining token budget, preemption by recompute), the KV capacity the preset leaves
(`capacity.num_gpu_blocks`) and vLLM's batch defaults for the device.

Two client shapes are replayed, both with identical requests:

- all at once (`--request-rate inf`, no concurrency limit): every request arrives at t = 0;
- one at a time (`--max-concurrency 1`): each request runs alone, so one request stands for all.

In both, which tokens each step carries depends only on the scheduler's state, never on how long
the steps take, so a scenario's schedule is built once (`schedule`) and re-priced cheaply for any
efficiency factors (`evaluate`): every step becomes a row of aggregates, and the step times are a
vectorised form of `roofline.step_cost` (a test pins the two together).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from backends.perf.presets import Preset, resolve_preset
from backends.perf.roofline import batch_defaults, kv_bytes_per_token_per_device, num_gpu_blocks
from sim.kv_cache import KVCacheManager
from sim.scheduler import Request, Scheduler

BLOCK_SIZE = 16  # vLLM's default on GPUs
GPU_MEMORY_UTILIZATION = 0.9  # the benchmarks ran `vllm serve` with its default


@dataclass(frozen=True, slots=True)
class Workload:
    """`num_prompts` identical requests of `input_tokens` in and `output_tokens` out."""

    input_tokens: int
    output_tokens: int
    num_prompts: int
    all_at_once: bool  # False: one at a time (max concurrency 1)
    offline: bool = False  # `vllm bench latency`/`LLM`: no API server in front of the engine


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per step aggregates and per request step indices of one replayed workload."""

    tokens: np.ndarray  # tokens computed in the step
    sampled: np.ndarray  # sequences that sample a token (every scheduled request)
    attention_pairs: np.ndarray  # sum over new tokens of the context each attends to
    kv_read: np.ndarray  # KV tokens read by attention (context before the step's tokens)
    has_prefill: np.ndarray  # bool: the step carries prompt tokens
    first_token_step: np.ndarray  # per request: the step that produced its first token
    last_token_step: np.ndarray  # per request: the step that produced its last token
    outputs: np.ndarray  # per request: tokens generated
    requests_per_run: int  # requests the schedule stands for (num_prompts when one at a time)


@functools.cache
def schedule(preset_name: str, workload: Workload) -> Schedule:
    """Run the workload through the simulated engine's scheduler until every request finishes."""
    preset = resolve_preset(preset_name)
    max_seqs, budget = batch_defaults(preset)
    blocks = num_gpu_blocks(preset, BLOCK_SIZE, GPU_MEMORY_UTILIZATION, budget, max_seqs)
    scheduler = Scheduler(KVCacheManager(blocks, BLOCK_SIZE), max_seqs, budget)
    count = workload.num_prompts if workload.all_at_once else 1
    requests = [_request(i, workload) for i in range(count)]
    for req in requests:
        scheduler.add(req)
    rows: list[tuple[int, int, float, int, bool]] = []
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    index = {id(req): i for i, req in enumerate(requests)}
    done = 0
    while done < count:
        step = scheduler.schedule(0.0)
        if step.empty:
            raise RuntimeError(f"{preset_name}: {workload} cannot be scheduled (KV capacity {blocks} blocks)")
        tokens = sampled = kv_read = 0
        pairs = 0.0
        for _req, new, context in step.prefills:
            tokens += new
            sampled += 1
            pairs += new * (context + (new + 1) / 2)
            kv_read += context
        decodes = len(step.decodes)
        tokens += decodes
        sampled += decodes
        pairs += step.decode_context_sum + decodes
        kv_read += step.decode_context_sum
        step_index = len(rows)
        rows.append((tokens, sampled, pairs, kv_read, bool(step.prefills)))
        for req in scheduler.complete_step(step, float(step_index)):
            i = index[id(req)]
            if req.first_token_s is not None and i not in first:
                first[i] = step_index
            if req.num_output:
                last[i] = step_index
            if req.finished:
                done += 1
    data = np.array([r[:4] for r in rows], dtype=float)
    return Schedule(
        tokens=data[:, 0],
        sampled=data[:, 1],
        attention_pairs=data[:, 2],
        kv_read=data[:, 3],
        has_prefill=np.array([r[4] for r in rows], dtype=bool),
        first_token_step=np.array([first[i] for i in range(count)]),
        last_token_step=np.array([last[i] for i in range(count)]),
        outputs=np.array([req.num_output for req in requests], dtype=float),
        requests_per_run=workload.num_prompts,
    )


def _request(i: int, workload: Workload) -> Request:
    """Distinct prompt ids per request: random prompts share no prefix (no cache hits)."""
    base = 1 + i * workload.input_tokens
    prompt = list(range(base, base + workload.input_tokens))
    return Request(str(i), prompt, [0] * workload.output_tokens, "length", 0.0, workload.output_tokens)


def step_times(preset: Preset, s: Schedule) -> np.ndarray:
    """`roofline.step_cost(...).total_s` of every step, vectorised (same terms, same order)."""
    m, hw, eff, tp = preset.model, preset.hardware, preset.efficiency, preset.tp
    peak = tp**eff.tp_scaling * hw.peak_flops
    compute = (2.0 * m.layer_params * s.tokens + 2.0 * m.embedding_params * s.sampled) / (peak * eff.compute) + (
        4.0 * m.num_layers * m.num_heads * m.head_dim * s.attention_pairs
    ) / (peak * eff.attention_efficiency)
    weight_read = (m.layer_params + m.embedding_params) * m.dtype_bytes / tp
    memory = (weight_read + (s.kv_read + s.tokens) * kv_bytes_per_token_per_device(preset)) / (
        hw.hbm_bandwidth * eff.bandwidth
    )
    comm = np.zeros_like(s.tokens)
    if tp > 1:
        ring = 2.0 * (tp - 1) / tp * s.tokens * m.hidden_size * m.dtype_bytes
        comm = 2 * m.num_layers * (eff.allreduce_latency_s * math.log2(tp) + ring / hw.link_bandwidth)
    overhead = eff.step_overhead_s + np.where(s.has_prefill, eff.prefill_overhead_s, 0.0)
    if tp > 1:
        overhead = overhead + eff.tp_overhead_s * math.log2(tp)
    overhead = overhead + eff.sequence_overhead_s * s.sampled
    total: np.ndarray = np.maximum(compute, memory) + comm + overhead
    return total


@dataclass(frozen=True, slots=True)
class Outcome:
    ttft_s: float  # mean over requests
    tpot_s: float  # mean over requests of (last - first) / (outputs - 1)
    duration_s: float  # from the first arrival to the last token


def evaluate(preset: Preset, workload: Workload, s: Schedule) -> Outcome:
    """Mean TTFT, mean TPOT and duration of the run with the preset's factors."""
    ends = np.cumsum(step_times(preset, s))
    frontend = 0.0 if workload.offline else preset.efficiency.frontend_s
    first = ends[s.first_token_step]
    last = ends[s.last_token_step]
    ttft = frontend + first
    tpot = (last - first) / np.maximum(s.outputs - 1, 1)
    if workload.all_at_once:
        duration = frontend + float(ends[-1])
    else:  # one at a time: the same request again and again
        duration = workload.num_prompts * (frontend + float(ends[-1]))
    return Outcome(float(ttft.mean()), float(tpot.mean()), duration)

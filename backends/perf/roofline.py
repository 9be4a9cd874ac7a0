"""An engine's performance on a preset, as numbers: its KV capacity and batch defaults, how long it takes
to load, sleep and wake, and how long one engine step takes (the roofline).

One module because the three are one model of the same engine: the step time and the load times
both read the weight and KV bytes the capacity part computes.

KV capacity
-----------
How much a device holds: KV bytes per token, vLLM's KV block count and its batch defaults.

The simulated engine sizes its KV cache with these, and the predictor's prior uses the same engine
limits, so both see the engine a `Preset` describes.

Loading, sleeping, waking
-------------------------
How long an engine takes to come up, to go to sleep and to wake: weights moved over a link.

- Start-up: the weights read from storage at the load bandwidth, plus a fixed initialisation
  (CUDA context, memory profiling, CUDA-graph capture, compilation). `--load-format dummy` reads no
  weights (random ones are generated on the device), so only the initialisation remains.
- Sleep level 1 (vLLM's sleep mode): each device copies its share of the weights to pinned host
  memory over its own PCIe link and drops the KV cache; waking copies them back the same way.
- Sleep level 2: weights and KV cache are dropped at once; waking reloads the weights from storage at
  the load bandwidth (what an operator does after a level-2 wake). The process, its CUDA graphs and
  its compiled kernels survive both levels, so neither wake pays the initialisation again.

The load bandwidth and the initialisation are properties of the host and of the engine build more
than of the GPU, hence one default for every preset, overridable per engine.

Step time
---------
How long one engine step takes on a preset: the roofline shared by the simulated engine and the prior.

A step of a vLLM-style engine runs every scheduled token through the model once: prefill chunks
(many new tokens of one request, after `context_before` tokens already in its KV cache) and decode
tokens (one per running request, after `context` tokens). Its duration is a roofline:

    step = max(compute, memory) + all-reduce + overhead

- compute: matmul FLOPs (2 x parameters per token, the LM head only for sequences that sample) plus
  attention FLOPs (QK^T and PV over each token's context; causal inside a chunk), divided by the
  peak FLOP/s of one device x TP^tp_scaling (TP speeds up compute less than linearly) times the
  fitted compute efficiency;
- memory: bytes of weights read once per step plus the KV read by attention and written for the new
  tokens, per device, over HBM bandwidth times the fitted bandwidth efficiency;
- all-reduce (TP > 1): two per layer, each a latency that grows with log2(TP) plus a ring transfer of
  the step's activations over the device link;
- overhead: fixed per step, larger when the step carries prefill (eager kernels, no CUDA graph) and
  growing with log2(TP) (the host coordinates more workers).

Everything here is a pure function of a `Preset` (no clocks, no asyncio): the simulated engine prices
its steps with it, the latency predictor derives its analytic prior from it, and the calibration
benchmark fits it, so recalibrating the simulator is visibly a change to the prior.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from backends.perf.hardware import GIB
from backends.perf.presets import Preset

# Memory vLLM's profiler sees besides weights and KV: CUDA context, NCCL buffers, cuBLAS workspaces
# and CUDA graphs. About 1.5-3 GiB on Hopper in practice; one constant keeps the estimate simple.
NON_TORCH_BYTES = int(2.0 * GIB)


def kv_bytes_per_token(preset: Preset) -> int:
    """Bytes of K and V one token occupies across the whole model (all layers, all TP ranks).

    This is what a PD transfer moves per prompt token.
    """
    m = preset.model
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes


def kv_bytes_per_token_per_device(preset: Preset) -> int:
    """Bytes per token on one device: KV heads are split over TP, replicated when TP > KV heads."""
    m = preset.model
    heads_per_device = max(1, math.ceil(m.num_kv_heads / preset.tp))
    return 2 * m.num_layers * heads_per_device * m.head_dim * m.dtype_bytes


def weight_bytes_per_device(preset: Preset) -> int:
    return preset.model.weight_bytes // preset.tp


def activation_peak_bytes(preset: Preset, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """vLLM's profile run peak beyond weights: hidden states and MLP intermediates of a full token
    budget, plus float32 logits for every sequence of a full batch."""
    m = preset.model
    per_token = (4 * m.hidden_size + 2 * m.intermediate_size // preset.tp) * m.dtype_bytes
    logits = max_num_seqs * m.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


def num_gpu_blocks(
    preset: Preset,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
) -> int:
    """KV blocks vLLM would allocate: (capacity x utilisation - weights - activations - non-torch)
    per device over the per-device bytes of one block. Raises ValueError when the model does not fit,
    as vLLM refuses to start ("No available memory for the cache blocks")."""
    hw = preset.hardware
    budget = int(hw.hbm_capacity * gpu_memory_utilization)
    free = (
        budget
        - weight_bytes_per_device(preset)
        - activation_peak_bytes(preset, max_num_batched_tokens, max_num_seqs)
        - NON_TORCH_BYTES
    )
    block_bytes = block_size * kv_bytes_per_token_per_device(preset)
    if free < block_bytes:
        raise ValueError(
            f"{preset.name}: no memory left for KV cache blocks "
            f"({free / GIB:.1f} GiB after weights at gpu_memory_utilization={gpu_memory_utilization})"
        )
    return free // block_bytes


def batch_defaults(preset: Preset) -> tuple[int, int]:
    """vLLM's (max_num_seqs, max_num_batched_tokens) by device memory (get_batch_defaults)."""
    memory_gib = preset.hardware.hbm_capacity / GIB
    if memory_gib >= 160:
        return 1024, 16384
    if memory_gib >= 70 and not preset.hardware.name.startswith("a100"):
        return 1024, 8192
    return 256, 2048


DEFAULT_LOAD_BANDWIDTH: Final = 2e9  # bytes/s from storage to the devices (safetensors, page cache cold)
DEFAULT_INIT_S: Final = 5.0  # seconds of engine initialisation beyond reading weights
# Pinned host<->device copies reach about this share of the PCIe link's peak per direction.
PCIE_EFFICIENCY: Final = 0.8
SLEEP_LEVELS: Final = (1, 2)


def weight_load_s(preset: Preset, load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH) -> float:
    """Seconds to read the model's weights from storage (all of them, at `load_bandwidth` bytes/s)."""
    if load_bandwidth <= 0:
        raise ValueError("load bandwidth must be > 0")
    return preset.model.weight_bytes / load_bandwidth


def startup_s(
    preset: Preset,
    load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH,
    init_s: float = DEFAULT_INIT_S,
    load_weights: bool = True,
) -> float:
    """Seconds from launch until the engine serves: weights ÷ load bandwidth + initialisation."""
    if init_s < 0:
        raise ValueError("init_s must be >= 0")
    return (weight_load_s(preset, load_bandwidth) if load_weights else 0.0) + init_s


def host_copy_s(preset: Preset) -> float:
    """Seconds to copy one device's share of the weights between it and pinned host memory (the TP
    ranks copy in parallel, each over its own link)."""
    return weight_bytes_per_device(preset) / (preset.hardware.pcie_bandwidth * PCIE_EFFICIENCY)


def sleep_s(preset: Preset, level: int) -> float:
    """Seconds `POST /sleep?level=N` takes: level 1 offloads the weights, level 2 only frees memory."""
    _check_level(level)
    return host_copy_s(preset) if level == 1 else 0.0


def wake_s(preset: Preset, level: int, load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH) -> float:
    """Seconds to bring the weights back after sleeping at `level` (the KV cache is only reallocated)."""
    _check_level(level)
    return host_copy_s(preset) if level == 1 else weight_load_s(preset, load_bandwidth)


def _check_level(level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, not {level}")


@dataclass(frozen=True, slots=True)
class StepCost:
    """The parts of one step's duration, in seconds (total = max(compute, memory) + comm + overhead)."""

    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float

    @property
    def device_s(self) -> float:
        """Kernel time alone (what per-kernel profiles measure): the roofline plus all-reduces."""
        return max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def total_s(self) -> float:
        return self.device_s + self.overhead_s


def prefill_compute(preset: Preset) -> tuple[float, float, float]:
    """`step_cost`'s compute seconds of one prefill chunk of n new tokens after c cached ones, as
    coefficients: per_token_s * n + per_chunk_s + per_pair_s * n * (c + (n + 1) / 2). For a caller
    that prices chunks on every request (the router's supply meter, policies/routing/kv_tiers.py): it
    takes them once per preset and evaluates the sum itself, keeping this module off the request's walk."""
    m, hw, eff = preset.model, preset.hardware, preset.efficiency
    peak = preset.tp**eff.tp_scaling * hw.peak_flops
    linear = peak * eff.compute
    per_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim / (peak * eff.attention_efficiency)
    return 2.0 * m.layer_params / linear, 2.0 * m.embedding_params / linear, per_pair


def step_cost(
    preset: Preset,
    prefill_chunks: Sequence[tuple[int, int]] = (),
    decode_contexts: Sequence[int] = (),
) -> StepCost:
    """The cost parts of one step.

    prefill_chunks: (new_tokens, context_before) per request that prefills in this step.
    decode_contexts: per decoding request, the tokens already in its KV cache before this token.
    """
    m = preset.model
    hw = preset.hardware
    eff = preset.efficiency
    tp = preset.tp

    prefill_tokens = 0
    attn_pairs = 0.0  # sum over new tokens of the context they attend to
    kv_read_tokens = 0
    for new_tokens, context in prefill_chunks:
        prefill_tokens += new_tokens
        attn_pairs += new_tokens * (context + (new_tokens + 1) / 2)
        kv_read_tokens += context
    num_decodes = len(decode_contexts)
    if num_decodes:
        decode_ctx_sum = sum(decode_contexts)
        attn_pairs += decode_ctx_sum + num_decodes
        kv_read_tokens += decode_ctx_sum
    tokens = prefill_tokens + num_decodes
    if tokens == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0)
    sampled = len(prefill_chunks) + num_decodes

    linear_flops = 2.0 * m.layer_params * tokens + 2.0 * m.embedding_params * sampled
    attn_flops = 4.0 * m.num_layers * m.num_heads * m.head_dim * attn_pairs
    peak = tp**eff.tp_scaling * hw.peak_flops
    compute_s = linear_flops / (peak * eff.compute) + attn_flops / (peak * eff.attention_efficiency)

    kv_token_bytes = kv_bytes_per_token_per_device(preset)
    weight_read = (m.layer_params + m.embedding_params) * m.dtype_bytes / tp
    kv_bytes = (kv_read_tokens + tokens) * kv_token_bytes
    memory_s = (weight_read + kv_bytes) / (hw.hbm_bandwidth * eff.bandwidth)

    comm_s = 0.0
    if tp > 1:
        ring_bytes = 2.0 * (tp - 1) / tp * tokens * m.hidden_size * m.dtype_bytes
        per_allreduce = eff.allreduce_latency_s * math.log2(tp) + ring_bytes / hw.link_bandwidth
        comm_s = 2 * m.num_layers * per_allreduce

    overhead_s = eff.step_overhead_s + (eff.prefill_overhead_s if prefill_tokens else 0.0)
    if tp > 1:
        overhead_s += eff.tp_overhead_s * math.log2(tp)
    overhead_s += eff.sequence_overhead_s * sampled
    return StepCost(compute_s, memory_s, comm_s, overhead_s)


class StepTimer:
    """`step_time_s` for one preset with the per-preset constants computed once, taking the decode
    contexts as (count, sum): what the engine calls every step. Same operations in the same order as
    `step_cost`, so the durations are bit-identical."""

    __slots__ = (
        "_attn",
        "_attn_div",
        "_comm",
        "_comm_bytes",
        "_compute_div",
        "_embed",
        "_kv_token_bytes",
        "_layer",
        "_memory_div",
        "_overhead",
        "_prefill_overhead",
        "_sequence_overhead",
        "_tp",
        "_weight_read",
    )

    def __init__(self, preset: Preset) -> None:
        m = preset.model
        hw = preset.hardware
        eff = preset.efficiency
        tp = preset.tp
        self._tp = tp
        self._layer = 2.0 * m.layer_params
        self._embed = 2.0 * m.embedding_params
        self._attn = 4.0 * m.num_layers * m.num_heads * m.head_dim
        peak = tp**eff.tp_scaling * hw.peak_flops
        self._compute_div: float = peak * eff.compute
        self._attn_div: float = peak * eff.attention_efficiency
        self._sequence_overhead = eff.sequence_overhead_s
        self._kv_token_bytes = kv_bytes_per_token_per_device(preset)
        self._weight_read = (m.layer_params + m.embedding_params) * m.dtype_bytes / tp
        self._memory_div = hw.hbm_bandwidth * eff.bandwidth
        self._comm_bytes = 2.0 * (tp - 1) / tp if tp > 1 else 0.0
        self._comm: tuple[float, int, int, float, int] | None = None
        if tp > 1:
            self._comm = (
                eff.allreduce_latency_s * math.log2(tp),
                m.hidden_size,
                m.dtype_bytes,
                hw.link_bandwidth,
                2 * m.num_layers,
            )
        overhead = eff.step_overhead_s
        prefill_overhead = eff.step_overhead_s + eff.prefill_overhead_s
        if tp > 1:
            overhead += eff.tp_overhead_s * math.log2(tp)
            prefill_overhead += eff.tp_overhead_s * math.log2(tp)
        self._overhead = overhead
        self._prefill_overhead = prefill_overhead

    def __call__(self, prefill_chunks: Sequence[tuple[int, int]], num_decodes: int, decode_context_sum: int) -> float:
        prefill_tokens = 0
        attn_pairs = 0.0
        kv_read_tokens = 0
        for new_tokens, context in prefill_chunks:
            prefill_tokens += new_tokens
            attn_pairs += new_tokens * (context + (new_tokens + 1) / 2)
            kv_read_tokens += context
        if num_decodes:
            attn_pairs += decode_context_sum + num_decodes
            kv_read_tokens += decode_context_sum
        tokens = prefill_tokens + num_decodes
        if tokens == 0:
            return 0.0
        sampled = len(prefill_chunks) + num_decodes
        compute_s = (self._layer * tokens + self._embed * sampled) / self._compute_div + (
            self._attn * attn_pairs
        ) / self._attn_div
        memory_s = (self._weight_read + (kv_read_tokens + tokens) * self._kv_token_bytes) / self._memory_div
        comm_s = 0.0
        if self._comm is not None:
            latency, hidden, dtype_bytes, link, count = self._comm
            ring_bytes = self._comm_bytes * tokens * hidden * dtype_bytes
            comm_s = count * (latency + ring_bytes / link)
        overhead_s = self._prefill_overhead if prefill_tokens else self._overhead
        overhead_s += self._sequence_overhead * sampled
        return max(compute_s, memory_s) + comm_s + overhead_s


def step_time_s(
    preset: Preset,
    prefill_chunks: Sequence[tuple[int, int]] = (),
    decode_contexts: Sequence[int] = (),
) -> float:
    """Duration in seconds of one engine step that runs this work (0.0 for an empty step)."""
    return step_cost(preset, prefill_chunks, decode_contexts).total_s


def prefill_time_s(preset: Preset, prompt_tokens: int, cached_tokens: int = 0) -> float:
    """One uncontended prefill of a prompt in a single step (no chunking): a TTFT lower bound."""
    new_tokens = max(1, prompt_tokens - cached_tokens)
    return step_time_s(preset, [(new_tokens, prompt_tokens - new_tokens)])


def decode_step_time_s(preset: Preset, batch_size: int, context_tokens: int) -> float:
    """One decode step of `batch_size` requests that each hold `context_tokens` in their KV cache."""
    return step_time_s(preset, (), [context_tokens] * batch_size)


def kv_transfer_time_s(preset: Preset, tokens: int, bandwidth_bytes_per_s: float) -> float:
    """Time to pull `tokens` of KV from a prefill instance over a link of the given bandwidth."""
    if tokens <= 0:
        return 0.0
    return tokens * kv_bytes_per_token(preset) / bandwidth_bytes_per_s

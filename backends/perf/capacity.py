"""How much a device holds: KV bytes per token, vLLM's KV block count and its batch defaults.

The simulated engine sizes its KV cache with these, and the predictor's prior uses the same engine
limits, so both see the engine a `Preset` describes.
"""

from __future__ import annotations

import math

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

"""Step times composed from AIConfigurator's kernel latencies measured inside vLLM 0.24 (H100, H200).

A step of a dense Llama layer stack is, kernel by kernel: per layer the QKV, O, gate-up and down
GEMMs at M = tokens of the step, the attention kernel (FlashAttention-3 context attention for a
prefill, decode attention over the KV length for a decode step) and two all-reduces at TP > 1; then
the LM-head GEMM for the sampled rows. Latencies between measured grid points are interpolated
linearly (in M, N, K, sequence length, batch and message size). The sum has no CPU time, norms,
activations or launch gaps, so it is compared with the performance model's device time
(`StepCost.device_s`), not its total.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.perf.presets import ModelSpec, resolve_preset
from bench.sim_calibration.sources import Row

SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm"}


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Linear interpolation, linear extrapolation past the last two points (never below zero)."""
    if x >= xs[-1] and len(xs) > 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return max(ys[-1] + slope * (x - xs[-1]), 0.0)
    return float(np.interp(x, xs, ys))


def _bracket(value: int, grid: list[int]) -> tuple[int, int, float]:
    """Neighbours in `grid` and the weight of the upper one (clamped inside the grid)."""
    if value <= grid[0]:
        return grid[0], grid[0], 0.0
    if value >= grid[-1]:
        return grid[-1], grid[-1], 0.0
    i = bisect.bisect_left(grid, value)
    lo, hi = grid[i - 1], grid[i]
    return lo, hi, (value - lo) / (hi - lo)


@dataclass
class KernelTables:
    gemm: dict[tuple[int, int], tuple[list[float], list[float]]]  # (n, k) -> (m grid, ms)
    gemm_n: list[int]
    gemm_k: list[int]
    context: dict[tuple[int, int, int], tuple[list[float], list[float]]]  # (batch, heads, kv) -> isl
    generation: dict[tuple[int, int], dict[int, tuple[list[float], list[float]]]]  # (h, kv) -> b -> step
    allreduce: dict[tuple[int, str], tuple[list[float], list[float]]]  # (gpus, backend) -> size

    def gemm_ms(self, m: int, n: int, k: int) -> float:
        scale = 1.0
        if n > self.gemm_n[-1]:
            scale *= n / self.gemm_n[-1]
            n = self.gemm_n[-1]
        if k > self.gemm_k[-1]:
            scale *= k / self.gemm_k[-1]
            k = self.gemm_k[-1]
        n0, n1, wn = _bracket(n, self.gemm_n)
        k0, k1, wk = _bracket(k, self.gemm_k)
        total = 0.0
        for nn, w_n in ((n0, 1 - wn), (n1, wn)):
            for kk, w_k in ((k0, 1 - wk), (k1, wk)):
                if w_n * w_k == 0:
                    continue
                ms, lat = self.gemm[(nn, kk)]
                total += w_n * w_k * _interp(m, ms, lat)
        return total * scale

    def context_ms(self, isl: int, heads: int, kv_heads: int) -> float:
        xs, ys = self.context[(1, heads, kv_heads)]
        return _interp(isl, xs, ys)

    def generation_ms(self, batch: int, kv_len: int, heads: int, kv_heads: int) -> float:
        by_batch = self.generation[(heads, kv_heads)]
        batches = sorted(by_batch)
        b0, b1, wb = _bracket(batch, batches)
        lo = _interp(kv_len, *by_batch[b0])
        hi = _interp(kv_len, *by_batch[b1])
        return (1 - wb) * lo + wb * hi

    def allreduce_ms(self, gpus: int, size_bytes: int, graph: bool) -> float:
        xs, ys = self.allreduce[(gpus, "vllm_graph" if graph else "vllm_eager")]
        return float(np.exp(np.interp(np.log(size_bytes), np.log(xs), np.log(ys))))


def load_tables(traces: Path, hardware: str) -> KernelTables:
    import pyarrow.parquet as pq

    folder = traces / "aiconfigurator" / SYSTEMS[hardware] / "vllm_0.24.0"
    gemm_points: dict[tuple[int, int], list[tuple[int, float]]] = defaultdict(list)
    for r in pq.read_table(folder / "gemm_perf.parquet").to_pylist():
        if r["gemm_dtype"] == "bfloat16":
            gemm_points[(r["n"], r["k"])].append((r["m"], r["latency"]))
    context_points: dict[tuple[int, int, int], list[tuple[int, float]]] = defaultdict(list)
    for r in pq.read_table(folder / "context_attention_perf.parquet").to_pylist():
        if _plain_attention(r):
            key = (r["batch_size"], r["num_heads"], r["num_key_value_heads"])
            context_points[key].append((r["isl"], r["latency"]))
    gen_points: dict[tuple[int, int], dict[int, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in pq.read_table(folder / "generation_attention_perf.parquet").to_pylist():
        if _plain_attention(r):
            gen_points[(r["num_heads"], r["num_key_value_heads"])][r["batch_size"]].append((r["step"], r["latency"]))
    ar_points: dict[tuple[int, str], list[tuple[int, float]]] = defaultdict(list)
    for r in pq.read_table(folder / "custom_allreduce_perf.parquet").to_pylist():
        ar_points[(r["num_gpus"], r["backend"])].append((r["message_size"], r["latency"]))
    return KernelTables(
        gemm={k: _columns(v) for k, v in gemm_points.items()},
        gemm_n=sorted({n for n, _ in gemm_points}),
        gemm_k=sorted({k for _, k in gemm_points}),
        context={k: _columns(v) for k, v in context_points.items()},
        generation={hk: {b: _columns(v) for b, v in by_b.items()} for hk, by_b in gen_points.items()},
        allreduce={k: _columns(v) for k, v in ar_points.items()},
    )


def _plain_attention(r: dict[str, object]) -> bool:
    return (
        r["kv_cache_dtype"] == "bfloat16"
        and r["window_size"] == 0
        and r["head_dim"] == 128
        and r["kernel_source"] == "vllm_flash_attn_fa3"
    )


def _columns(points: list[tuple[int, float]]) -> tuple[list[float], list[float]]:
    merged: dict[int, list[float]] = defaultdict(list)
    for x, y in points:
        merged[x].append(y)
    xs = sorted(merged)
    return [float(x) for x in xs], [float(np.median(merged[x])) for x in xs]


def _layer_gemms_ms(t: KernelTables, m: ModelSpec, tp: int, tokens: int) -> float:
    q_kv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim // tp
    return (
        t.gemm_ms(tokens, q_kv, m.hidden_size)
        + t.gemm_ms(tokens, m.hidden_size, m.num_heads * m.head_dim // tp)
        + t.gemm_ms(tokens, 2 * m.intermediate_size // tp, m.hidden_size)
        + t.gemm_ms(tokens, m.hidden_size, m.intermediate_size // tp)
    )


def prefill_ms(t: KernelTables, m: ModelSpec, tp: int, isl: int) -> float:
    heads, kv = m.num_heads // tp, max(1, m.num_kv_heads // tp)
    layer = _layer_gemms_ms(t, m, tp, isl) + t.context_ms(isl, heads, kv)
    if tp > 1:
        layer += 2 * t.allreduce_ms(tp, isl * m.hidden_size * m.dtype_bytes, graph=False)
    return m.num_layers * layer + t.gemm_ms(1, m.vocab_size // tp, m.hidden_size)


def decode_ms(t: KernelTables, m: ModelSpec, tp: int, batch: int, context: int) -> float:
    heads, kv = m.num_heads // tp, max(1, m.num_kv_heads // tp)
    layer = _layer_gemms_ms(t, m, tp, batch) + t.generation_ms(batch, context, heads, kv)
    if tp > 1:
        layer += 2 * t.allreduce_ms(tp, batch * m.hidden_size * m.dtype_bytes, graph=True)
    return m.num_layers * layer + t.gemm_ms(batch, m.vocab_size // tp, m.hidden_size)


PREFILL_LENGTHS = (128, 512, 1024, 2048, 4096, 8192, 16384)  # context attention is measured to 16k
# (batch, context): short contexts at every batch, long ones (>= 16k, measured to 64k) at batch 1 and 8
DECODE_POINTS = (
    *((batch, context) for batch in (1, 8, 32, 128) for context in (512, 2048, 8192)),
    *((batch, context) for batch in (1, 8) for context in (16_383, 32_767, 65_535)),
)
CONFIGS = {
    "h100": [
        "llama-3.1-8b@h100",
        "llama-3.1-8b-tp2@h100",
        "llama-3.1-70b-tp4@h100",
        "llama-3.1-70b-tp8@h100",
        "qwen2.5-7b@h100",
    ],
    "h200": [
        "llama-3.1-8b@h200",
        "llama-3.1-70b-tp2@h200",
        "llama-3.1-70b-tp4@h200",
        "llama-3.1-70b-tp8@h200",
        "qwen2.5-7b@h200",
    ],
}


def aiconfigurator_rows(traces: Path) -> list[Row]:
    rows: list[Row] = []
    for hardware, presets in CONFIGS.items():
        tables = load_tables(traces, hardware)
        for name in presets:
            preset = resolve_preset(name)
            m, tp = preset.model, preset.tp
            if (m.num_heads // tp, max(1, m.num_kv_heads // tp)) not in tables.generation:
                continue
            rows.extend(
                Row(
                    "aiconfigurator", "prefill", name, 1, isl, 0, prefill_ms(tables, m, tp, isl) / 1e3, device_only=True
                )
                for isl in PREFILL_LENGTHS
            )
            rows.extend(
                Row(
                    "aiconfigurator",
                    "decode",
                    name,
                    batch,
                    0,
                    context,
                    decode_ms(tables, m, tp, batch, context) / 1e3,
                    device_only=True,
                )
                for batch, context in DECODE_POINTS
            )
    return rows

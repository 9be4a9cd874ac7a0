"""Model shapes, hardware datasheets and fitted efficiency factors: what a simulated engine "is".

A preset name composes a model and a hardware: ``MODEL[-tpN]@HW``, e.g. ``llama-3.1-8b@h100`` or
``llama-3.1-70b-tp4@h100``. Shapes come from each model's Hugging Face ``config.json``; peak dense
BF16 FLOP/s, HBM bandwidth and capacity from the vendor datasheets (cited next to each entry).

The datasheet numbers are peaks. What a real serving stack reaches is a fraction of them, plus host
costs per step and per scheduled sequence, per all-reduce, and per request in the API server. Those
fractions and costs are the `Efficiency` of a hardware entry; ``bench/sim_calibration`` fits them to
published serving runs of vLLM (replayed through the simulator's scheduler) and pastes them here,
with the errors in bench/results/sim-calibration.md. Hardware without public runs borrows the factors
of its nearest sibling, or keeps older ones (``calibrated=False``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final

GIB: Final = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Transformer shape. Parameter counts are derived from it, not typed in, so they cannot drift.

    `gated_ffn` is True for SwiGLU MLPs (Llama, Qwen: three matrices), False for the classic two-matrix
    MLP (OPT, BLOOM). `tied_embeddings` means the LM head reuses the embedding matrix (its FLOPs still
    count; its bytes are read once).
    """

    name: str
    hf_id: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    gated_ffn: bool = True
    tied_embeddings: bool = False
    dtype_bytes: int = 2  # bf16/fp16 weights and KV cache
    source: str = ""

    @property
    def attention_params_per_layer(self) -> int:
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_and_o + k_and_v

    @property
    def mlp_params_per_layer(self) -> int:
        matrices = 3 if self.gated_ffn else 2
        return matrices * self.hidden_size * self.intermediate_size

    @property
    def layer_params(self) -> int:
        """Matmul parameters of all decoder layers (norms and biases are negligible)."""
        return self.num_layers * (self.attention_params_per_layer + self.mlp_params_per_layer)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        heads = 1 if self.tied_embeddings else 2
        return self.layer_params + heads * self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fitted factors that turn datasheet peaks into step times (see roofline.step_time_s).

    - `compute`: achieved fraction of peak dense FLOP/s on the matmuls of a step.
    - `attention`: the same for attention (QK^T and PV); None: `compute`. Attention kernels over long
      contexts run at their own efficiency, far from the GEMMs' on some stacks.
    - `bandwidth`: achieved fraction of peak HBM bandwidth when streaming weights and KV.
    - `step_overhead_s`: fixed cost of every step (launches, scheduler, sampling, detokenising).
    - `prefill_overhead_s`: extra fixed cost of a step that carries prefill tokens (no CUDA graph).
    - `sequence_overhead_s`: host cost per scheduled sequence per step (preparing inputs, sampling,
      processing and streaming outputs): what makes large batches slower than their kernels.
    - `allreduce_latency_s`: latency of one all-reduce per doubling of the TP group (two per layer).
    - `tp_scaling`: exponent of the speed-up of compute over TP (1 = perfect; measured prefills scale
      worse, as each device's matmuls get smaller and less efficient).
    - `tp_overhead_s`: host cost per step per doubling of TP (broadcasting the schedule to the TP
      workers and gathering their results).
    - `frontend_s`: latency a request spends outside the engine's steps before its first token
      reaches the client (HTTP, chat template and tokenisation, the hop to the engine core, and
      detokenising and streaming the first token back). It adds to TTFT only; later tokens are
      pipelined behind the steps.
    - `calibrated`: whether these numbers were fitted on this hardware's own measurements.
    """

    compute: float
    bandwidth: float
    step_overhead_s: float
    prefill_overhead_s: float
    allreduce_latency_s: float
    tp_scaling: float = 1.0
    tp_overhead_s: float = 0.0
    frontend_s: float = 0.0
    attention: float | None = None
    sequence_overhead_s: float = 0.0
    calibrated: bool = True
    note: str = ""

    @property
    def attention_efficiency(self) -> float:
        return self.compute if self.attention is None else self.attention


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator as its datasheet states it, plus the fitted `efficiency` of serving on it."""

    name: str
    description: str
    peak_flops: float  # dense BF16/FP16 tensor FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_capacity: int  # bytes
    link_bandwidth: float  # bytes/s per direction between devices of one TP group
    efficiency: Efficiency
    source: str = ""
    pcie_bandwidth: float = 32e9  # bytes/s per direction between host memory and one device (peak)


@dataclass(frozen=True, slots=True)
class Preset:
    """A model served on `tp` devices of one hardware kind: everything the performance model needs."""

    name: str
    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    efficiency: Efficiency = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "efficiency", self.hardware.efficiency)

    def with_efficiency(self, efficiency: Efficiency) -> Preset:
        """A copy with other factors (the calibration fit explores with it)."""
        hardware = replace(self.hardware, efficiency=efficiency)
        return Preset(self.name, self.model, hardware, self.tp)


# --- models -------------------------------------------------------------------------------------

_MODELS: dict[str, ModelSpec] = {}


def _model(spec: ModelSpec) -> None:
    _MODELS[spec.name] = spec


# https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (8.03B parameters)
_model(
    ModelSpec(
        "llama-3.1-8b",
        "meta-llama/Llama-3.1-8B",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_model_len=131072,
        source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
    )
)
# https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json (70.6B parameters)
_model(
    ModelSpec(
        "llama-3.1-70b",
        "meta-llama/Llama-3.1-70B",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        max_model_len=131072,
        source="https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json",
    )
)
# https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json (69.0B parameters)
_model(
    ModelSpec(
        "llama-2-70b",
        "meta-llama/Llama-2-70b-hf",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=32000,
        max_model_len=4096,
        source="https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json",
    )
)
# https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json (7.61B parameters)
_model(
    ModelSpec(
        "qwen2.5-7b",
        "Qwen/Qwen2.5-7B-Instruct",
        num_layers=28,
        hidden_size=3584,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
        max_model_len=32768,
        source="https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json",
    )
)
# The Qwen3 dense models exist because public vLLM benchmarks measured them (bench/sim_calibration).
# https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json (8.19B parameters)
_model(
    ModelSpec(
        "qwen3-8b",
        "Qwen/Qwen3-8B",
        num_layers=36,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        max_model_len=40960,
        source="https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
    )
)
# https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json (14.8B parameters)
_model(
    ModelSpec(
        "qwen3-14b",
        "Qwen/Qwen3-14B",
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=17408,
        vocab_size=151936,
        max_model_len=40960,
        source="https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json",
    )
)
# The next three exist because the calibration data measured them (splitwise_sim, DistServe).
# https://huggingface.co/bigscience/bloom/blob/main/config.json (176B; MHA, 4h GELU MLP, tied head)
_model(
    ModelSpec(
        "bloom-176b",
        "bigscience/bloom",
        num_layers=70,
        hidden_size=14336,
        num_heads=112,
        num_kv_heads=112,
        head_dim=128,
        intermediate_size=4 * 14336,
        vocab_size=250880,
        max_model_len=2048,
        gated_ffn=False,
        tied_embeddings=True,
        source="https://huggingface.co/bigscience/bloom/blob/main/config.json",
    )
)
# https://huggingface.co/facebook/opt-13b/blob/main/config.json (12.9B; ReLU MLP, tied head)
_model(
    ModelSpec(
        "opt-13b",
        "facebook/opt-13b",
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        intermediate_size=20480,
        vocab_size=50272,
        max_model_len=2048,
        gated_ffn=False,
        tied_embeddings=True,
        source="https://huggingface.co/facebook/opt-13b/blob/main/config.json",
    )
)
# https://huggingface.co/facebook/opt-66b/blob/main/config.json (65.7B; ReLU MLP, tied head)
_model(
    ModelSpec(
        "opt-66b",
        "facebook/opt-66b",
        num_layers=64,
        hidden_size=9216,
        num_heads=72,
        num_kv_heads=72,
        head_dim=128,
        intermediate_size=36864,
        vocab_size=50272,
        max_model_len=2048,
        gated_ffn=False,
        tied_embeddings=True,
        source="https://huggingface.co/facebook/opt-66b/blob/main/config.json",
    )
)

MODELS: Final = MappingProxyType(_MODELS)

# --- hardware -----------------------------------------------------------------------------------
# Efficiency factors below are written by `python -m bench.sim_calibration --fit --write-presets`
# (bench/results/sim-calibration.md has the rows, the errors and the plot). Do not edit by hand.

# BEGIN FITTED EFFICIENCY
_EFF_A100 = Efficiency(
    compute=0.5663,
    bandwidth=0.7446,
    step_overhead_s=0.0,
    prefill_overhead_s=0.0,
    allreduce_latency_s=0.0,
    tp_scaling=0.8917,
    tp_overhead_s=0.006262,
    frontend_s=0.003528,
    sequence_overhead_s=0.0003326,
)
_EFF_H100 = Efficiency(
    compute=0.3536,
    bandwidth=0.675,
    step_overhead_s=0.0,
    prefill_overhead_s=0.0,
    allreduce_latency_s=7.023e-06,
    tp_scaling=0.7035,
    tp_overhead_s=0.004389,
    frontend_s=0.003528,
    sequence_overhead_s=0.0001817,
)
_EFF_H100_PCAP = Efficiency(
    compute=0.5503,
    bandwidth=0.7038,
    step_overhead_s=0.002029,
    prefill_overhead_s=0.0127,
    allreduce_latency_s=4.373e-05,
    tp_scaling=0.644,
    tp_overhead_s=0.0,
    frontend_s=0.0,
    sequence_overhead_s=0.0,
)
_EFF_H200 = Efficiency(
    compute=0.3536,
    bandwidth=0.675,
    step_overhead_s=0.0,
    prefill_overhead_s=0.0,
    allreduce_latency_s=6.567e-06,
    tp_scaling=0.7785,
    tp_overhead_s=0.004389,
    frontend_s=0.003528,
    sequence_overhead_s=0.0001817,
    note="H100 factors (same Hopper chip and stack); checked on vLLM CI's batch-8 latency",
)
_EFF_H20 = Efficiency(
    compute=0.7093,
    bandwidth=0.7635,
    step_overhead_s=0.006331,
    prefill_overhead_s=0.00571,
    allreduce_latency_s=7.023e-06,
    tp_scaling=0.7035,
    tp_overhead_s=0.004389,
    frontend_s=0.0,
    sequence_overhead_s=0.0,
    calibrated=False,
    note="no public H20 run found: the 2024 H100 fit (kernel sums, 2023-24 engines), unchanged",
)
_EFF_ASCEND_910B = Efficiency(
    compute=0.6366,
    bandwidth=0.7446,
    step_overhead_s=0.0,
    prefill_overhead_s=0.0,
    allreduce_latency_s=0.0,
    tp_scaling=0.8917,
    tp_overhead_s=0.006262,
    frontend_s=0.003528,
    attention=0.1105,
    sequence_overhead_s=0.0003326,
    note="prefill (GEMM, attention) fitted on vLLM-Ascend 0.9.1; decode and host factors from a100",
)
# END FITTED EFFICIENCY

_HARDWARE: dict[str, HardwareSpec] = {}


def _hardware(spec: HardwareSpec) -> None:
    _HARDWARE[spec.name] = spec


# NVIDIA A100 80GB SXM4 datasheet: 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, 80 GB, NVLink 600 GB/s
# (bidirectional, so 300 GB/s per direction), PCIe Gen4 64 GB/s (32 GB/s per direction).
# https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
_hardware(
    HardwareSpec(
        "a100",
        "NVIDIA A100 80GB SXM4",
        peak_flops=312e12,
        hbm_bandwidth=2.039e12,
        hbm_capacity=80 * GIB,
        link_bandwidth=300e9,
        efficiency=_EFF_A100,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        pcie_bandwidth=32e9,
    )
)
# NVIDIA A100 40GB SXM4: the same chip with 1,555 GB/s of HBM2 and 40 GB (same datasheet).
_hardware(
    HardwareSpec(
        "a100-40gb",
        "NVIDIA A100 40GB SXM4",
        peak_flops=312e12,
        hbm_bandwidth=1.555e12,
        hbm_capacity=40 * GIB,
        link_bandwidth=300e9,
        efficiency=_EFF_A100,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        pcie_bandwidth=32e9,
    )
)
# NVIDIA H100 SXM5 datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity), 3.35 TB/s HBM3, 80 GB,
# NVLink 900 GB/s bidirectional, PCIe Gen5 128 GB/s (64 GB/s per direction).
# https://www.nvidia.com/en-us/data-center/h100/
# (same figures in ai-dynamo/aiconfigurator systems/h100_sxm.yaml).
_hardware(
    HardwareSpec(
        "h100",
        "NVIDIA H100 80GB SXM5",
        peak_flops=989e12,
        hbm_bandwidth=3.35e12,
        hbm_capacity=80 * GIB,
        link_bandwidth=450e9,
        efficiency=_EFF_H100,
        source="https://www.nvidia.com/en-us/data-center/h100/",
        pcie_bandwidth=64e9,
    )
)
# The power-capped H100 of the Splitwise paper (ISCA'24, Patel et al.): same silicon and datasheet,
# lower sustained clocks, hence its own fitted compute efficiency.
_hardware(
    HardwareSpec(
        "h100-pcap",
        "NVIDIA H100 80GB SXM5, power-capped (Splitwise)",
        peak_flops=989e12,
        hbm_bandwidth=3.35e12,
        hbm_capacity=80 * GIB,
        link_bandwidth=450e9,
        efficiency=_EFF_H100_PCAP,
        source="https://www.nvidia.com/en-us/data-center/h100/ ; https://arxiv.org/abs/2311.18677",
        pcie_bandwidth=64e9,
    )
)
# NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s, PCIe Gen5
# 128 GB/s.
# https://www.nvidia.com/en-us/data-center/h200/  Kernel timings only (AIConfigurator): device factors
# fitted on them, overheads from H100.
_hardware(
    HardwareSpec(
        "h200",
        "NVIDIA H200 141GB SXM",
        peak_flops=989e12,
        hbm_bandwidth=4.8e12,
        hbm_capacity=141 * GIB,
        link_bandwidth=450e9,
        efficiency=_EFF_H200,
        source="https://www.nvidia.com/en-us/data-center/h200/",
        pcie_bandwidth=64e9,
    )
)
# NVIDIA H20 (Hopper, China export SKU): 148 TFLOPS FP16/BF16 dense, 96 GB HBM3 at 4.0 TB/s,
# NVLink 900 GB/s, PCIe Gen5 x16. NVIDIA publishes no public datasheet page; figures as reported in the HGX H20
# product brief, e.g. https://willitrunai.com/gpus/h20-96gb and SemiAnalysis (Nov 2023).
_hardware(
    HardwareSpec(
        "h20",
        "NVIDIA H20 96GB",
        peak_flops=148e12,
        hbm_bandwidth=4.0e12,
        hbm_capacity=96 * GIB,
        link_bandwidth=450e9,
        efficiency=_EFF_H20,
        source="https://willitrunai.com/gpus/h20-96gb",
        pcie_bandwidth=64e9,
    )
)
# Huawei Ascend 910B (as in Atlas 800I/800T A2): about 313 TFLOPS FP16 dense (the 910B3 bin; 910B1/B2
# are rated higher), 64 GB HBM2e at about 1.6 TB/s, HCCS 392 GB/s (7 links x 56 GB/s) between the 8
# NPUs of a node. Huawei's product pages give only node-level figures:
# https://e.huawei.com/en/products/computing/ascend/atlas-800i-a2 ; per-chip figures as widely reported
# (e.g. https://boardor.com/blog/huawei-ascend-910b-outperforms-h20-910c-approaches-h100). Uncalibrated:
# A100-class factors (a 7 nm part with similar peak FLOP/s and a less mature kernel stack).
_hardware(
    HardwareSpec(
        "ascend-910b",
        "Huawei Ascend 910B 64GB",
        peak_flops=313e12,
        hbm_bandwidth=1.6e12,
        hbm_capacity=64 * GIB,
        link_bandwidth=196e9,
        efficiency=_EFF_ASCEND_910B,
        source="https://e.huawei.com/en/products/computing/ascend/atlas-800i-a2",
        pcie_bandwidth=32e9,  # PCIe 4.0 x16 assumed: Huawei's public pages give no per-chip host link
    )
)

HARDWARE: Final = MappingProxyType(_HARDWARE)

DEFAULT_PRESET: Final = "llama-3.1-8b@h100"
_PRESET_RE: Final = re.compile(r"^(?P<model>[a-z0-9.\-]+?)(?:-tp(?P<tp>\d+))?@(?P<hw>[a-z0-9.\-]+)$")


class UnknownPresetError(ValueError):
    """The preset name does not parse or names an unknown model or hardware."""


def resolve_preset(name: str, tp: int | None = None) -> Preset:
    """`"llama-3.1-70b-tp4@h100"` → Preset(model, hardware, tp=4).

    `tp` (e.g. from ``-tp``) overrides a missing ``-tpN`` suffix; a suffix and a different explicit
    `tp` is an error, since one of them is a typo.
    """
    match = _PRESET_RE.match(name.strip().lower())
    if match is None:
        raise UnknownPresetError(f"preset {name!r} is not MODEL[-tpN]@HARDWARE")
    model = MODELS.get(match["model"])
    hardware = HARDWARE.get(match["hw"])
    if model is None:
        raise UnknownPresetError(f"unknown model {match['model']!r}; known: {', '.join(sorted(MODELS))}")
    if hardware is None:
        raise UnknownPresetError(f"unknown hardware {match['hw']!r}; known: {', '.join(sorted(HARDWARE))}")
    suffix_tp = int(match["tp"]) if match["tp"] else None
    if suffix_tp is not None and tp is not None and tp != suffix_tp and tp != 1:
        raise UnknownPresetError(f"preset {name!r} says tp={suffix_tp} but tp={tp} was given")
    resolved_tp = suffix_tp or tp or 1
    if resolved_tp < 1 or model.num_heads % resolved_tp:
        raise UnknownPresetError(f"tp={resolved_tp} does not divide the {model.num_heads} attention heads")
    canonical = f"{model.name}{f'-tp{resolved_tp}' if resolved_tp > 1 else ''}@{hardware.name}"
    return Preset(canonical, model, hardware, resolved_tp)


def is_preset_name(name: str) -> bool:
    """Whether `name` parses as a known preset (the CLI's positional MODEL may be one, or a model id)."""
    try:
        resolve_preset(name)
    except UnknownPresetError:
        return False
    return True


def preset_names() -> list[str]:
    """Every MODEL@HW combination (TP variants are open-ended and not listed)."""
    return [f"{m}@{h}" for m in sorted(MODELS) for h in sorted(HARDWARE)]

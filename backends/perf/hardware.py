"""Accelerators as their datasheets state them, and the fitted efficiency of serving on each.

Peak dense BF16 FLOP/s, HBM bandwidth and capacity come from the vendor datasheets (cited next to
each entry). The datasheet numbers are peaks. What a real serving stack reaches is a fraction of
them, plus host costs per step and per scheduled sequence, per all-reduce, and per request in the API
server. Those fractions and costs are the `Efficiency` of a hardware entry; ``bench/sim_calibration``
fits them to published serving runs of vLLM (replayed through the simulator's scheduler) and pastes
them here, with the errors in bench/results/sim-calibration.md. Hardware without public runs borrows
the factors of its nearest sibling, or keeps older ones (``calibrated=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

GIB: Final = 1 << 30


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

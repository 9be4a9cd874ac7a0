"""Published serving measurements of real engines, transcribed with their sources.

Each `Measurement` is one benchmark run: a model on one accelerator, a workload (`scenarios.Workload`)
and the run's reported mean TTFT, mean TPOT and duration. Numbers are copied from the cited pages;
where a page gives a workload only approximately (ShareGPT lengths, a rounded rate) the note says
how it was reduced to fixed lengths. Nothing here is measured by this project.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.sim_calibration.scenarios import Workload


@dataclass(frozen=True, slots=True)
class Source:
    url: str
    engine: str
    note: str


@dataclass(frozen=True, slots=True)
class Measurement:
    source: str  # key of SOURCES
    preset: str
    label: str
    workload: Workload
    ttft_ms: float | None = None  # mean (or the page's only figure)
    tpot_ms: float | None = None
    duration_s: float | None = None
    note: str = ""

    @property
    def context(self) -> str:
        """Context class for the report: long is a prompt of 16k tokens or more."""
        return "long (>=16k)" if self.workload.input_tokens >= 16_000 else "short (<16k)"


_GPUSTACK = "https://github.com/gpustack/gpustack/blob/main/docs/performance-lab/"

SOURCES: dict[str, Source] = {
    "gpustack-qwen3-14b-a100": Source(
        _GPUSTACK + "qwen3-14b/a100.md",
        "vLLM 0.11.0",
        "`vllm serve Qwen/Qwen3-14B` defaults; `vllm bench serve` random prompts, request rate inf",
    ),
    "gpustack-qwen3-14b-h100": Source(
        _GPUSTACK + "qwen3-14b/h100.md",
        "vLLM 0.11.0",
        "`vllm serve Qwen/Qwen3-14B` defaults; `vllm bench serve` random prompts, request rate inf",
    ),
    "gpustack-qwen3-8b-h100": Source(
        _GPUSTACK + "qwen3-8b/h100-latency.md",
        "vLLM 0.11.0",
        "`vllm serve Qwen/Qwen3-8B`; `vllm bench serve` ShareGPT, 100 prompts, max concurrency 1 "
        "(23,260 input and 22,061 output tokens: replayed as 233 in, 221 out)",
    ),
    "gpustack-qwen3-8b-910b": Source(
        _GPUSTACK + "qwen3-8b/910b.md",
        "vLLM-Ascend 0.9.1",
        "`vllm serve Qwen/Qwen3-8B` on one Ascend 910B; random prompts, request rate inf",
    ),
    "musgrave-llama-8b-a100-40gb": Source(
        "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on",
        "vLLM 0.23.0",
        "`vllm serve meta-llama/Llama-3.1-8B-Instruct` on an A100 40GB; 1,024 in, 128 out, max "
        'concurrency 1: "decode at one request per time runs at about 75 tokens/sec" (TPOT 13.3 ms)',
    ),
    "inferencebench-llama-8b-h100": Source(
        "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/",
        "vLLM 0.21.0",
        "Llama-3.1-8B-Instruct fp16 on an H100-80GB-HBM3, workload chatbot-short at concurrency 1: "
        "TTFT p50 13.98 ms, TPOT p50 6.48 ms (medians: one request at a time, they are the run's "
        "typical request; the page gives no prompt length: replayed as 256 in, 256 out)",
    ),
    "vllm-ci-h200": Source(
        "https://buildkite.com/vllm/performance-benchmark/builds/9515",
        "vLLM (CI build 9515)",
        "vLLM's performance CI, latency_llama8B_tp1 on H200: `vllm bench latency`, 32 in, 128 out, "
        "batch 8, median end-to-end latency 833.53 ms (offline: no API server)",
    ),
}


def _random(tokens: int, out: int, prompts: int) -> Workload:
    return Workload(tokens, out, prompts, all_at_once=True)


MEASUREMENTS: tuple[Measurement, ...] = (
    # Qwen3-14B, one A100 80GB, vLLM 0.11 (GPUStack performance lab, "Other Benchmark Cases", baseline)
    Measurement(
        "gpustack-qwen3-14b-a100",
        "qwen3-14b@a100",
        "random 32k x100",
        _random(32_000, 99, 100),
        ttft_ms=359_648.08,
        tpot_ms=445.58,
        duration_s=724.56,
    ),
    Measurement(
        "gpustack-qwen3-14b-a100",
        "qwen3-14b@a100",
        "random 4k x500",
        _random(3_996, 200, 500),
        ttft_ms=197_625.03,
        tpot_ms=254.61,
        duration_s=407.05,
    ),
    Measurement(
        "gpustack-qwen3-14b-a100",
        "qwen3-14b@a100",
        "random 2k x500",
        _random(1_996, 100, 500),
        ttft_ms=86_908.30,
        tpot_ms=301.73,
        duration_s=175.66,
    ),
    # Qwen3-14B, one H100 SXM, vLLM 0.11
    Measurement(
        "gpustack-qwen3-14b-h100",
        "qwen3-14b@h100",
        "random 32k x100",
        _random(32_000, 99, 100),
        ttft_ms=191_024.43,
        tpot_ms=277.44,
        duration_s=386.80,
    ),
    Measurement(
        "gpustack-qwen3-14b-h100",
        "qwen3-14b@h100",
        "random 4k x500",
        _random(3_996, 200, 500),
        ttft_ms=112_716.92,
        tpot_ms=132.45,
        duration_s=227.57,
    ),
    Measurement(
        "gpustack-qwen3-14b-h100",
        "qwen3-14b@h100",
        "random 2k x500",
        _random(1_996, 100, 500),
        ttft_ms=50_716.13,
        tpot_ms=206.51,
        duration_s=98.91,
    ),
    # Qwen3-8B, one H100 SXM, vLLM 0.11, one request at a time
    Measurement(
        "gpustack-qwen3-8b-h100",
        "qwen3-8b@h100",
        "ShareGPT, concurrency 1",
        Workload(233, 221, 100, all_at_once=False),
        ttft_ms=59.01,
        tpot_ms=7.28,
    ),
    # Qwen3-8B, one Ascend 910B, vLLM-Ascend 0.9.1
    Measurement(
        "gpustack-qwen3-8b-910b",
        "qwen3-8b@ascend-910b",
        "random 32k x100",
        _random(32_000, 100, 100),
        ttft_ms=559_550.01,
        tpot_ms=344.18,
        duration_s=1_110.48,
    ),
    Measurement(
        "gpustack-qwen3-8b-910b",
        "qwen3-8b@ascend-910b",
        "random 4k x500",
        _random(3_995, 200, 500),
        ttft_ms=132_541.20,
        tpot_ms=99.26,
        duration_s=273.17,
    ),
    Measurement(
        "gpustack-qwen3-8b-910b",
        "qwen3-8b@ascend-910b",
        "random 2k x500",
        _random(1_996, 100, 500),
        ttft_ms=53_978.52,
        tpot_ms=140.39,
        duration_s=109.30,
    ),
    # Llama-3.1-8B
    Measurement(
        "musgrave-llama-8b-a100-40gb",
        "llama-3.1-8b@a100-40gb",
        "1k in, 128 out, concurrency 1",
        Workload(1_024, 128, 20, all_at_once=False),
        tpot_ms=1e3 / 75,
    ),
    Measurement(
        "inferencebench-llama-8b-h100",
        "llama-3.1-8b@h100",
        "chatbot-short, concurrency 1",
        Workload(256, 256, 20, all_at_once=False),
        ttft_ms=13.98,
        tpot_ms=6.48,
    ),
    Measurement(
        "vllm-ci-h200",
        "llama-3.1-8b@h200",
        "32 in, 128 out, batch 8 (end to end)",
        Workload(32, 128, 8, all_at_once=True, offline=True),
        duration_s=0.83353,
    ),
)

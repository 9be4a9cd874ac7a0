"""Measured timings the simulator is calibrated against, as comparable rows.

Each `Row` is one measurement the performance model can predict: a prefill of `batch` prompts of
`prompt` tokens in one step, or one decode step of `batch` requests at `context` tokens each, for a
preset (model, hardware, TP). Three sources, copied from `Mutinifni/splitwise-sim`, `LLMServe/DistServe` and
`ai-dynamo/aiconfigurator` respectively:

- splitwise_sim/perf_model.csv: end-to-end prefill times and per-token decode times (TBT), measured
  on DGX-A100/H100 for llama2-70b and bloom-176b;
- distserve/profiler-a100-80g.vllm.json: DistServe's coefficients fitted to vLLM profiles on A100,
  evaluated on a grid inside their profiled range (opt-13b, opt-66b);
- aiconfigurator/*: per-kernel latencies measured inside vLLM 0.24 on H100/H200 (kernels.py composes
  them into step times, which have no CPU overhead: compared with the model's device time).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

SPLITWISE_MODELS = {"llama2-70b": "llama-2-70b", "bloom-176b": "bloom-176b"}
SPLITWISE_HARDWARE = {"a100-80gb": "a100", "h100-80gb": "h100", "h100-80gb-pcap": "h100-pcap"}
DISTSERVE_MODELS = {"facebook/opt-13b": "opt-13b", "facebook/opt-66b": "opt-66b"}


@dataclass(frozen=True, slots=True)
class Row:
    source: str  # "splitwise", "distserve-vllm", "aiconfigurator"
    kind: str  # "prefill" or "decode"
    preset: str  # e.g. "llama-2-70b-tp4@h100"
    batch: int
    prompt: int  # prefill: tokens per prompt; decode: unused (0)
    context: int  # decode: tokens in each request's KV cache; prefill: 0
    measured_s: float
    device_only: bool = False  # kernel sums: compare without the fixed per-step overhead


def _preset(model: str, tp: int, hardware: str) -> str:
    return f"{model}{f'-tp{tp}' if tp > 1 else ''}@{hardware}"


def splitwise_rows(traces: Path) -> list[Row]:
    """Every row of perf_model.csv as one prefill and one decode comparison.

    token_time is the mean time between tokens over a generation whose real length is not recorded
    for large `token_size` (generation stopped early); it is recovered from e2e = prompt + (n-1) x tbt
    and the decode context is taken at the middle of the generation.
    """
    path = traces / "splitwise_sim" / "perf_model.csv"
    rows: list[Row] = []
    with path.open(newline="") as f:
        for rec in csv.DictReader(f):
            preset = _preset(
                SPLITWISE_MODELS[rec["model"]],
                int(rec["tensor_parallel"]),
                SPLITWISE_HARDWARE[rec["hardware"]],
            )
            batch, prompt = int(rec["batch_size"]), int(rec["prompt_size"])
            prompt_ms, token_ms = float(rec["prompt_time"]), float(rec["token_time"])
            generated = round((float(rec["e2e_time"]) - prompt_ms) / token_ms) + 1
            generated = max(1, min(int(rec["token_size"]), generated))
            rows.append(Row("splitwise", "prefill", preset, batch, prompt, 0, prompt_ms / 1e3))
            rows.append(Row("splitwise", "decode", preset, batch, 0, prompt + generated // 2, token_ms / 1e3))
    return rows


def _kv_capacity_tokens(traces: Path) -> dict[tuple[str, int], int]:
    """KV capacity in tokens per (model, tp) without pipeline parallelism (max_num_tokens.csv)."""
    out: dict[tuple[str, int], int] = {}
    with (traces / "distserve" / "max_num_tokens.csv").open(newline="") as f:
        for rec in csv.DictReader(f):
            if int(rec["pp"]) == 1:
                out[(rec["model"], int(rec["tp"]))] = int(rec["max_num_tokens"])
    return out


def distserve_rows(traces: Path) -> list[Row]:
    """DistServe's fitted vLLM latency functions on a grid inside their profiled domain.

    prefill_ms = a + b*T + c*T^2 over the batch's total tokens T; decode_ms = a + b*C + c*B over the
    batch's total context C and batch size B, with separate coefficients above the batch threshold
    (simdistserve/estimators/time_estimator.py).
    """
    path = traces / "distserve" / "profiler-a100-80g.vllm.json"
    data = json.loads(path.read_text())
    capacity = _kv_capacity_tokens(traces)
    rows: list[Row] = []
    for hf_id, by_tp in data.items():
        model = DISTSERVE_MODELS.get(hf_id)
        if model is None:
            continue
        for tp_text, coeffs in by_tp.items():
            preset = _preset(model, int(tp_text), "a100")
            kv_tokens = capacity.get((hf_id, int(tp_text)), 0)
            a, b, c = coeffs["prefill"]
            for batch in (1, 2, 4, 8):
                for prompt in (128, 256, 512, 1024, 2048):
                    total = batch * prompt
                    if total > 4096:
                        continue
                    ms = a + b * total + c * total * total
                    rows.append(Row("distserve-vllm", "prefill", preset, batch, prompt, 0, ms / 1e3))
            threshold = coeffs["decoding_large_small_bs_threshold"]
            for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                key = "decoding_smallbs" if batch < threshold else "decoding_largebs"
                a, b, c = coeffs[key]
                for context in (128, 512, 1024, 1536):
                    if batch * context > kv_tokens:
                        continue  # outside what the profiled engine could hold in its KV cache
                    ms = a + b * batch * context + c * batch
                    rows.append(Row("distserve-vllm", "decode", preset, batch, 0, context, ms / 1e3))
    return rows

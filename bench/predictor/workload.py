"""What the benchmark sends: trace requests (arrivals and lengths) and prompt text of exact length.

Azure LLM inference 2023, conversation trace (`azure_llm_2023/AzureLLMInferenceTrace_conv.csv`):
arrival times and (context, generated) token counts, a contiguous window; every prompt is unique.
Mooncake's synthetic trace (`mooncake/synthetic_trace.jsonl`) adds prefix sharing: `hash_ids` name
512-token blocks, and equal ids get equal text, so a conversation's later turns hit the prefix cache
of the engine that served the earlier ones (its inputs are long: the window keeps prompts that fit
the engine's context). Prompt words are cl100k tokens of the form " word" (one token each, never
merged), so the gateway's count, the engine's and the trace's agree; the text comes from the
replay benchmark's `PromptBuilder`.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime

from bench.replay import workload as replay_workload
from bench.replay.workload import BLOCK_TOKENS as BLOCK_TOKENS
from bench.replay.workload import PromptBuilder as PromptBuilder
from bench.traces import TRACES, require

AZURE_CONV = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceRequest(replay_workload.TraceRequest):
    """A replay request (arrival, lengths, Mooncake blocks) and which tenant sends it."""

    sheddable: bool = False  # sent by the sheddable tenant


def load_azure(requests: int, start: int, max_total_tokens: int, max_output_tokens: int) -> list[TraceRequest]:
    """`requests` consecutive rows from row `start` that fit the context (output capped)."""
    out: list[TraceRequest] = []
    t0: datetime | None = None
    with require(AZURE_CONV).open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if len(out) >= requests:
                break
            prompt = max(1, int(row["ContextTokens"]))
            output = min(max(1, int(row["GeneratedTokens"])), max_output_tokens)
            if prompt + output > max_total_tokens:
                continue
            head, _, frac = row["TIMESTAMP"].partition(".")
            when = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")
            t0 = t0 or when
            out.append(TraceRequest(len(out), (when - t0).total_seconds(), prompt, output))
    return out


def load_mooncake(requests: int, seed: int, max_total_tokens: int, max_output_tokens: int) -> list[TraceRequest]:
    """About `requests` requests: whole conversations (grouped by first block), seeded, in order."""
    return [
        TraceRequest(r.index, r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids)
        for r in replay_workload.load_mooncake(require(MOONCAKE), requests, seed, max_total_tokens, max_output_tokens)
    ]


def with_sheddable_share(requests: list[TraceRequest], share: float, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    return [
        TraceRequest(r.index, r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, rng.random() < share)
        for r in requests
    ]


def arrivals_at(requests: list[TraceRequest], rate_per_s: float) -> list[float]:
    """Arrival offsets (wall seconds) keeping the trace's burstiness at a mean of `rate_per_s`."""
    if len(requests) < 2:
        return [0.0] * len(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    factor = (len(requests) - 1) / span / rate_per_s if span > 0 else 1.0 / rate_per_s
    return [(r.arrival_s - requests[0].arrival_s) * factor for r in requests]

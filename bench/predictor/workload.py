"""What the benchmark sends: trace requests (arrivals and lengths) and prompt text of exact length.

Azure LLM inference 2023, conversation trace (`azure_llm_2023/AzureLLMInferenceTrace_conv.csv`):
arrival times and (context, generated) token counts, a contiguous window; every prompt is unique.
Mooncake's synthetic trace (`mooncake/synthetic_trace.jsonl`) adds prefix sharing: `hash_ids` name
512-token blocks, and equal ids get equal text, so a conversation's later turns hit the prefix cache
of the engine that served the earlier ones (its inputs are long: the window keeps prompts that fit
the engine's context). Prompt words are cl100k tokens of the form " word" (one token each, never
merged), so the gateway's count, the engine's and the trace's agree.
"""

from __future__ import annotations

import csv
import functools
import json
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TRACES = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
AZURE_CONV = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_s: float  # trace seconds after the window's first request
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake blocks; empty: unique text
    sheddable: bool = False  # sent by the sheddable tenant


def require(path: Path) -> Path:
    if not path.exists():
        raise SystemExit(f"trace missing: {path} (the benchmark reads ../shared/data/traces; see SOURCES.md there)")
    return path


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
    rows = [json.loads(line) for line in require(MOONCAKE).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["input_length"] + min(r["output_length"], max_output_tokens) <= max_total_tokens]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[row["hash_ids"][0]].append(i)
    order = list(groups)
    random.Random(seed).shuffle(order)
    chosen: list[int] = []
    for root in order:
        if len(chosen) >= requests:
            break
        chosen.extend(groups[root])
    chosen.sort()
    t0 = rows[chosen[0]]["timestamp"]
    out = []
    for n, i in enumerate(chosen):
        row = rows[i]
        ids = tuple(int(h) for h in row["hash_ids"])
        out.append(TraceRequest(
            n, (row["timestamp"] - t0) / 1000.0, min(int(row["input_length"]), len(ids) * BLOCK_TOKENS),
            min(max(1, int(row["output_length"])), max_output_tokens), ids,
        ))
    return out


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


@functools.cache
def _vocabulary() -> tuple[str, ...]:
    from backends import tokenization

    encoding = tokenization.encoding()
    pattern = re.compile(rb" [a-z]{3,9}")
    words = []
    for token in range(encoding.n_vocab):
        try:
            raw = encoding.decode_single_token_bytes(token)
        except KeyError:
            continue
        if pattern.fullmatch(raw):
            words.append(raw.decode())
    return tuple(words)


class PromptBuilder:
    """Exactly `input_tokens` tokens per prompt; equal Mooncake blocks give equal text."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.words = _vocabulary()
        self._blocks: dict[int, str] = {}

    def _block(self, hash_id: int, tokens: int = BLOCK_TOKENS) -> str:
        if tokens < BLOCK_TOKENS:
            rng = random.Random(hash_id * 1_000_003 + self.seed)
            return "".join(rng.choices(self.words, k=BLOCK_TOKENS)[:tokens])
        text = self._blocks.get(hash_id)
        if text is None:
            rng = random.Random(hash_id * 1_000_003 + self.seed)
            text = self._blocks[hash_id] = "".join(rng.choices(self.words, k=BLOCK_TOKENS))
        return text

    def prompt(self, request: TraceRequest, salt: str) -> str:
        if not request.hash_ids:
            rng = random.Random(f"{self.seed}:{salt}:{request.index}")
            return "".join(rng.choices(self.words, k=request.input_tokens))
        full, rest = divmod(request.input_tokens, BLOCK_TOKENS)
        parts = [self._block(h) for h in request.hash_ids[:full]]
        if rest:
            parts.append(self._block(request.hash_ids[full], rest))
        return "".join(parts)

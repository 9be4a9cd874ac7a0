"""Replay workloads: which requests, when, how long, and the text that makes equal prefixes equal.

Mooncake (`mooncake/synthetic_trace.jsonl`): `hash_ids` name 512-token blocks; a request's prompt is
its blocks' text in order, the last block cut to `input_length`. Block text is a deterministic
function of the id (512 words drawn from cl100k tokens of the form " word", so a block is exactly
512 tokens and concatenation never merges tokens across a boundary): equal ids give equal prefixes
for every tokenizer-free router (text radix trees) and for the engines' token-block hashes alike.

Azure (`azure_llm_2023/AzureLLMInferenceTrace_{code,conv}.csv`): lengths and arrivals only; every
prompt is unique text (no sharing), a control for routers that chase prefixes.

Subsets. Mooncake's sharing lives in multi-turn conversations that span the whole 1,022 s trace
(the first 400 requests alone share 5 % of their blocks; the whole trace 64 %), so a subset is a
seeded random sample of *conversations* (requests grouped by their first block) with every request
of each, original timestamps kept; the replay then compresses time to the target rate. Azure
subsets are a contiguous window. Arrival times are in trace seconds from the first request and are
rescaled per run (`scaled_arrivals`).
"""

from __future__ import annotations

import csv
import functools
import json
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

BLOCK_TOKENS = 512  # Mooncake's hash_id granularity


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_s: float  # trace seconds after the subset's first request
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake blocks; empty: unique text (Azure)


def load_mooncake(
    path: Path, requests: int, seed: int, max_total_tokens: int, max_output_tokens: int | None = None
) -> list[TraceRequest]:
    """About `requests` requests: whole conversations sampled at random (seeded), in arrival order.

    Outputs are capped at `max_output_tokens` (when given); requests whose prompt + output exceed
    `max_total_tokens` (the engine's context) are dropped."""
    cap = max_output_tokens if max_output_tokens is not None else 1 << 62
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["output_length"] = min(int(row["output_length"]), cap)
    rows = [r for r in rows if r["input_length"] + r["output_length"] <= max_total_tokens]
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
    out: list[TraceRequest] = []
    for n, i in enumerate(chosen):
        row = rows[i]
        ids = tuple(int(h) for h in row["hash_ids"])
        input_tokens = min(int(row["input_length"]), len(ids) * BLOCK_TOKENS)
        output_tokens = max(1, int(row["output_length"]))
        out.append(TraceRequest(n, (row["timestamp"] - t0) / 1000.0, input_tokens, output_tokens, ids))
    return out


def load_azure(path: Path, requests: int, start: int, max_total_tokens: int) -> list[TraceRequest]:
    """`requests` consecutive rows from row `start` (lengths and arrivals; no prefix sharing)."""
    out: list[TraceRequest] = []
    t0: datetime | None = None
    with path.open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if len(out) >= requests:
                break
            prompt, output = int(row["ContextTokens"]), max(1, int(row["GeneratedTokens"]))
            if prompt + output > max_total_tokens:
                continue
            when = _azure_time(row["TIMESTAMP"])
            t0 = t0 or when
            out.append(TraceRequest(len(out), (when - t0).total_seconds(), max(1, prompt), output))
    return out


def _azure_time(text: str) -> datetime:
    # "2023-11-16 18:17:03.9799600": seven fractional digits; datetime takes six
    head, _, frac = text.partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")


def infinite_cache_hit_ratio(requests: Sequence[TraceRequest]) -> float:
    """Share of prompt blocks whose whole prefix was seen before (an unbounded cache, one engine)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for r in requests:
        for k in range(1, len(r.hash_ids) + 1):
            prefix = r.hash_ids[:k]
            total += 1
            if prefix in seen:
                hits += 1
            else:
                seen.add(prefix)
    return hits / total if total else 0.0


def best_case_cached_tokens(requests: Sequence[TraceRequest]) -> list[tuple[int, int]]:
    """(prompt tokens, tokens of its leading blocks seen earlier in the subset) per request: what an
    unbounded cache on one engine would hold for it."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in requests:
        hit = 0
        for k in range(1, len(r.hash_ids) + 1):
            prefix = r.hash_ids[:k]
            if prefix in seen and hit == k - 1:
                hit = k
            seen.add(prefix)
        out.append((r.input_tokens, min(hit * BLOCK_TOKENS, r.input_tokens)))
    return out


def scaled_arrivals(requests: Sequence[TraceRequest], rate_per_s: float) -> list[float]:
    """Arrival times (same unit as 1 / rate) that keep the trace's shape at a mean of `rate_per_s`."""
    if len(requests) < 2:
        return [0.0 for _ in requests]
    span = requests[-1].arrival_s - requests[0].arrival_s
    native = (len(requests) - 1) / span if span > 0 else rate_per_s
    factor = native / rate_per_s
    return [(r.arrival_s - requests[0].arrival_s) * factor for r in requests]


@functools.cache
def _vocabulary() -> tuple[str, ...]:
    """cl100k tokens that are a space and 3-9 lowercase letters: one token each, never merged."""
    from backends import tokenization

    encoding = tokenization.encoding()
    words: list[str] = []
    pattern = re.compile(rb" [a-z]{3,9}")
    for token in range(encoding.n_vocab):
        try:
            raw = encoding.decode_single_token_bytes(token)
        except KeyError:
            continue
        if pattern.fullmatch(raw):
            words.append(raw.decode())
    return tuple(words)


class PromptBuilder:
    """Prompt text of a request; block texts are cached (conversations reuse them)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.words = _vocabulary()
        self._blocks: dict[int, tuple[str, ...]] = {}
        self._joined: dict[int, str] = {}

    def _block(self, hash_id: int) -> tuple[str, ...]:
        block = self._blocks.get(hash_id)
        if block is None:
            rng = random.Random(hash_id * 1_000_003 + self.seed)
            block = self._blocks[hash_id] = tuple(rng.choices(self.words, k=BLOCK_TOKENS))
        return block

    def _joined_block(self, hash_id: int) -> str:
        text = self._joined.get(hash_id)
        if text is None:
            text = self._joined[hash_id] = "".join(self._block(hash_id))
        return text

    def prompt(self, request: TraceRequest, salt: str = "") -> str:
        """Exactly `input_tokens` tokens; `salt` (unique per run) keeps Azure prompts unshared."""
        if not request.hash_ids:
            rng = random.Random(f"{self.seed}:{salt}:{request.index}")
            return "".join(rng.choices(self.words, k=request.input_tokens))
        full, rest = divmod(request.input_tokens, BLOCK_TOKENS)
        parts = [self._joined_block(h) for h in request.hash_ids[:full]]
        if rest:
            parts.append("".join(self._block(request.hash_ids[full])[:rest]))
        return "".join(parts)

"""A growing agent conversation counted with the model's own tokenizer: CPU per request and the
event loop's longest stall, whole encode against piece by piece (issue 46: "never scan or copy a
prompt more than once ... reuse a conversation's token ids for its known prefix, off the event loop").

    .venv/bin/python -m bench.overhead.tokenize_cost [--rounds 3] [--tokens 100000] [--vocab 32000]

Nothing is downloaded: a byte-level BPE of `--vocab` tokens is trained here on the Python standard
library's sources (the stand-in for a model's `tokenizer.json`; 4.3 characters per token on code,
like the large vocabularies), with ChatML's added tokens and template. The conversation is an agent's:
a ~5K-token system prompt, then turns of a user or tool message (tool results are standard library
source, 300 to 4,000 tokens) and an assistant answer, each request sending everything so far, until
`--tokens`. Each request is counted by the gateway's `ModelTokenizerCounter` on a running event loop
(a ticker task measures the loop's longest gap while it counts), three ways, in the same run:

- `before`: the code before this change: the rendered chat encoded whole by `Tokenizer.encode`,
  in a worker thread, which holds the GIL for the whole encode (the counter's whole-prompt cache
  misses on every grown prompt);
- `whole`: the same through `encode_batch`, which releases the GIL (the loop runs meanwhile);
- `pieces`: the default now: only the pieces of the rendering not seen before are encoded.

CPU is the process's (`time.process_time`: the tokenizer's own threads included). Writes
bench/results/overhead-tokenize.md, .png and raw/overhead-tokenize-raw.json.gz.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash
from tokenizers import Tokenizer

from backends.tokenization import ModelTokenizer
from bench import notes, raw
from policies.estimate import ModelTokenizerCounter
from tests.real_vllm.tiny_model import corpus, train_tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "results"
VARIANTS = ("before", "whole", "pieces")
TEMPLATE = (  # ChatML, as the conversation's messages need it (no tools)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class HoldsTheGil(ModelTokenizer):
    """The encode before this change: `Tokenizer.encode`, which keeps the GIL while it runs."""

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


def conversation(hf: Tokenizer, tokens: int, seed: int) -> list[list[dict[str, str]]]:
    """The requests of one agent run: each the messages so far, until the prompt passes `tokens`."""
    rng = random.Random(seed)
    text_pool = "\n".join(corpus(6_000_000, recursive=True, skip=40))
    chars_per_token = 4.3

    def text(n_tokens: int) -> str:
        start = rng.randrange(0, len(text_pool) - int(n_tokens * chars_per_token) - 1)
        return text_pool[start : start + int(n_tokens * chars_per_token)]

    messages = [{"role": "system", "content": text(5_000)}]
    requests = []
    total = 5_000
    turn = 0
    while total < tokens:
        if turn % 3 == 0:
            new = {"role": "user", "content": text(rng.randrange(50, 200))}
        else:
            new = {"role": "tool", "content": text(rng.randrange(300, 4_000))}
        messages.append(new)
        requests.append(list(messages))
        answer = {"role": "assistant", "content": text(rng.randrange(100, 500))}
        messages.append(answer)
        total = len(hf.encode("".join(m["content"] for m in messages), add_special_tokens=False).ids)
        turn += 1
    return requests


async def measure(counter: ModelTokenizerCounter, requests: Sequence[list[dict[str, str]]]) -> list[dict[str, Any]]:
    """Each request counted in turn; per request its tokens, CPU, wall time and the loop's longest gap."""
    rows = []
    for messages in requests:
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker(gaps: list[float] = gaps, done: asyncio.Event = done) -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.0005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.002)  # the ticker is running
        cpu, wall = time.process_time(), time.perf_counter()
        counted = await counter.count("chat", {"messages": messages})
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        done.set()
        await task
        assert counted is not None and counted.ids is not None
        rows.append(
            {
                "tokens": counted.tokens,
                "cpu_ms": cpu * 1e3,
                "wall_ms": wall * 1e3,
                "stall_ms": max(gaps) * 1e3 if gaps else 0.0,
                "ids_hash": xxhash.xxh3_64_hexdigest(bytes(counted.ids)),
            }
        )
    return rows


def run_variant(name: str, hf: Tokenizer, requests: Sequence[list[dict[str, str]]]) -> list[dict[str, Any]]:
    tokenizer = (HoldsTheGil if name == "before" else ModelTokenizer)(hf, {"default": TEMPLATE})
    if name != "pieces":
        tokenizer.pieces = None
    assert name != "pieces" or tokenizer.pieces is not None
    with ThreadPoolExecutor(max_workers=2) as executor:  # the gateway's counting pool
        counter = ModelTokenizerCounter(tokenizer, executor=executor)
        return asyncio.run(measure(counter, requests))


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    tail = [r for r in rows if r["tokens"] >= 0.8 * rows[-1]["tokens"]]
    return {
        "cpu_total_ms": sum(r["cpu_ms"] for r in rows),
        "cpu_tail_ms": statistics.median(r["cpu_ms"] for r in tail),
        "wall_tail_ms": statistics.median(r["wall_ms"] for r in tail),
        "stall_max_ms": max(r["stall_ms"] for r in rows),
        "stall_tail_ms": statistics.median(r["stall_ms"] for r in tail),
    }


def render(args: argparse.Namespace, runs: list[dict[str, Any]], png: str) -> str:
    by = {(r["variant"], r["round"]): summary(r["rows"]) for r in runs}
    rounds = sorted({r["round"] for r in runs})
    first = next(r for r in runs if r["variant"] == "pieces")["rows"]
    med = {v: {k: statistics.median(by[v, i][k] for i in rounds) for k in by[v, rounds[0]]} for v in VARIANTS}

    def spread(variant: str, key: str) -> str:
        values = [by[variant, i][key] for i in rounds]
        return f"{statistics.median(values):,.1f} ({min(values):,.1f} to {max(values):,.1f})"

    def ratio(key: str) -> float:
        return med["pieces"][key] / med["before"][key]

    lines = [
        "# Counting a growing conversation with the model's tokenizer: whole encode vs pieces",
        "",
        f"`python -m bench.overhead.tokenize_cost {' '.join(args.argv)}`".replace(" `", "`"),
        "",
        f"A byte-level BPE of {args.vocab:,} tokens trained here on the Python standard library (ChatML "
        f"template and added tokens); one agent conversation of {len(first)} requests growing from "
        f"{first[0]['tokens']:,} to {first[-1]['tokens']:,} prompt tokens (system prompt, user and tool "
        "messages, assistant answers), each request counted by `ModelTokenizerCounter` on a running event "
        f"loop with a 2-thread counting pool; {len(rounds)} rounds, the variants' order rotating. CPU is the "
        "process's (tokenizer threads included). Host: "
        f"{platform.machine()}, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(args.started))}.",
        "",
        "Median over rounds (range):",
        "",
        "| variant | CPU for the whole conversation (ms) | CPU per request, last fifth (ms) | "
        "wall per request, last fifth (ms) | longest loop stall (ms) | loop stall per request, last fifth (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {v} | {spread(v, 'cpu_total_ms')} | {spread(v, 'cpu_tail_ms')} | {spread(v, 'wall_tail_ms')} | "
        f"{spread(v, 'stall_max_ms')} | {spread(v, 'stall_tail_ms')} |"
        for v in VARIANTS
    ]
    same = all(
        [row["ids_hash"] for row in r["rows"]] == [row["ids_hash"] for row in first]
        for r in runs
        if r["round"] == rounds[0]
    )
    lines += [
        "",
        f"- pieces / before, CPU for the conversation: **{ratio('cpu_total_ms'):.3f}x**; "
        f"per request at the last fifth: **{ratio('cpu_tail_ms'):.3f}x**.",
        f"- Longest loop stall: before {med['before']['stall_max_ms']:.1f} ms, whole (GIL released) "
        f"{med['whole']['stall_max_ms']:.1f} ms, pieces {med['pieces']['stall_max_ms']:.1f} ms.",
        f"- The three variants' ids are {'identical' if same else '**not identical**'} for every request.",
        "",
        f"![CPU per request and loop stall by prompt length]({png})",
        "",
        *notes.section(args.out),
    ]
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for variant in VARIANTS:
        rows = next(r for r in runs if r["variant"] == variant)["rows"]
        xs = [r["tokens"] / 1000 for r in rows]
        axes[0].plot(xs, [r["cpu_ms"] for r in rows], marker=".", label=variant)
        axes[1].plot(xs, [r["stall_ms"] for r in rows], marker=".", label=variant)
    axes[0].set_title("CPU per request (ms)")
    axes[1].set_title("event loop's longest gap while counting (ms)")
    for ax in axes:
        ax.set_xlabel("prompt tokens (thousands)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "overhead-tokenize.md")
    p.add_argument("--report-only", action="store_true", help="re-render the report from its raw file")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.report_only:
        raw.rerender(args.out, render, plot)
        return 0
    args.started = time.time()
    hf = train_tokenizer(args.vocab, corpus_bytes=8_000_000, recursive=True)
    requests = conversation(hf, args.tokens, args.seed)
    runs = []
    for round_ in range(args.rounds):
        order = VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]
        for variant in order:
            rows = run_variant(variant, hf, requests)
            runs.append({"variant": variant, "round": round_, "rows": rows})
            s = summary(rows)
            print(
                f"round {round_} {variant:7s} cpu total {s['cpu_total_ms']:8.1f} ms, last fifth "
                f"{s['cpu_tail_ms']:6.1f} ms/request, stall max {s['stall_max_ms']:6.1f} ms",
                flush=True,
            )
    written = raw.write(args.out, args, runs, render, plot)
    print(f"wrote {args.out}, {args.out.with_suffix('.png')}, {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the agents benchmark sends: τ²-bench retail sessions replayed as agent programs.

A session (`exgentic_tau2_retail_10/<session>/trace.jsonl`: one litellm call per line) is a list of
turns, each a prompt that extends the previous turn's and the completion the agent produced; the
first line, a "hi" health check, is left out. A program of width W replays one session as W
branches in lock step: each turn sends W calls at once (one per branch) and the next turn starts
when all W have answered and a tool run (`tool_s`) has passed. Width 1 is a plain agent, 4 a small
fan-out, 40 a wide one (a map over 40 items, say) that saturates the pool on its own.

Prompts are exact-length text whose equal prefixes are equal (the replay benchmark's
`PromptBuilder` blocks of 512 tokens): every call starts with the same blocks (the sessions share
their system prompt and tools, about 5.2K tokens), and each branch's history is its own blocks, so
a branch's next turn finds its previous prompt in the engine's prefix cache when it is still there,
as a real agent's would. Outputs are the trace's completion lengths (`max_tokens` with `ignore_eos`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.replay.workload import BLOCK_TOKENS, PromptBuilder, TraceRequest

SHARED_BLOCKS = 10  # the system prompt and tools every session starts with (5,120 of its ~5.2K tokens)
_BRANCH_BLOCKS = 1_000  # block ids per branch: more than any prompt needs (11,252 tokens = 22 blocks)


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Program:
    """One agent program of the run: `session` replayed `width` calls a turn, from `start_s`."""

    name: str
    width: int
    session: Session
    start_s: float
    ident: int  # distinct per program of a run: its branches' block ids

    def block_ids(self, branch: int, prompt_tokens: int) -> tuple[int, ...]:
        """The prompt's blocks: the shared ones, then this branch's own history."""
        count = -(-prompt_tokens // BLOCK_TOKENS)
        own = count - SHARED_BLOCKS
        base = 1_000_000 + (self.ident * 64 + branch) * _BRANCH_BLOCKS
        return tuple(range(SHARED_BLOCKS)) + tuple(base + i for i in range(max(own, 0)))

    def prompt(self, builder: PromptBuilder, branch: int, turn: int) -> str:
        step = self.session.turns[turn]
        ids = self.block_ids(branch, step.prompt_tokens)
        return builder.prompt(TraceRequest(0, 0.0, step.prompt_tokens, step.output_tokens, ids))


def load_session(path: Path) -> Session:
    """A session's turns, the health-check line ("hi", a handful of tokens) left out."""
    turns: list[Turn] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("status") != "success" or int(row["prompt_tokens"]) < 100:
            continue
        turns.append(Turn(int(row["prompt_tokens"]), max(int(row["completion_tokens"]), 1)))
    return Session(path.parent.name, tuple(turns))


def load_sessions(folder: Path) -> list[Session]:
    sessions = [load_session(p) for p in sorted(folder.glob("*/trace.jsonl"))]
    return [s for s in sessions if s.turns]


def programs(
    sessions: Sequence[Session], widths: Sequence[tuple[int, int]], *, seed: int, stagger_s: float
) -> list[Program]:
    """The programs of one run: for each (width, how many), that many programs of that width, each
    a different session (drawn by `seed`). The widest starts at 0; the others at random times in
    (0, `stagger_s`], so they arrive while it runs."""
    rng = random.Random(seed)
    order = list(sessions)
    rng.shuffle(order)
    widest = max(width for width, _ in widths)
    if widest > 64 or sum(count for _, count in widths) > 100:
        raise ValueError("at most 64 branches per program and 100 programs per run (block ids)")
    out: list[Program] = []
    for width, count in sorted(widths, reverse=True):
        for _ in range(count):
            session = order[len(out) % len(order)]
            start_s = 0.0 if width == widest else rng.uniform(0.1 * stagger_s, stagger_s)
            ident = seed * 100 + len(out)  # block ids of one seed's programs are not another's
            out.append(Program(f"s{seed}-w{width}-{len(out)}", width, session, round(start_s, 3), ident))
    return out

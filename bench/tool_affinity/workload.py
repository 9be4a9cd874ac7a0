"""What the tool-affinity benchmark replays: τ²-bench retail sessions as agent programs, plus
unrelated one-shot traffic.

A session (`exgentic_tau2_retail_10/<session>/trace.jsonl`, one litellm call per line; the first,
a "hi" health check, left out) is a list of turns: prompt tokens, completion tokens, how the answer
ended (`tool_calls` or `stop`: the agent called a tool, or spoke to the simulated customer) and the
time from this call's start to the next call's start in the recording. That gap is the program's
pause before its next turn here (`gap_scale` times it): it holds the tool run (or the customer's
reply) and the recorded model's own latency, so it overstates the pause a little; the trace has
no end times to take that out.

Prompts are token ids whose equal prefixes are equal: every program starts with the same
`SHARED_TOKENS` (the sessions' identical system prompt and tools, about 5.2K tokens), then its own
history, one fixed random sequence per program cut to each turn's length (each turn's prompt
extends the last, as in the trace). Background requests are unique prompts of `background_tokens`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

SHARED_TOKENS = 5_120  # the system prompt and tools every session starts with
VOCAB = 30_000
_FINISH = re.compile(r"finish_reason.{0,4}?(tool_calls|stop|length)")


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int
    output_tokens: int
    tool_calls: bool  # the answer ended in tool calls
    gap_s: float  # recorded start-to-start time to the next turn (0 for the last)


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    turns: tuple[Turn, ...]


def load_session(path: Path) -> Session:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("status") == "success" and int(r["prompt_tokens"]) >= 100]
    starts = [datetime.fromisoformat(r["timestamp"]).timestamp() for r in rows]
    turns = []
    for i, row in enumerate(rows):
        response = row["response"] if isinstance(row["response"], str) else json.dumps(row["response"])
        found = _FINISH.search(response)
        gap = starts[i + 1] - starts[i] if i + 1 < len(rows) else 0.0
        turns.append(
            Turn(
                int(row["prompt_tokens"]),
                max(int(row["completion_tokens"]), 1),
                found is not None and found.group(1) == "tool_calls",
                max(gap, 0.0),
            )
        )
    return Session(path.parent.name, tuple(turns))


def load_sessions(folder: Path) -> list[Session]:
    sessions = [load_session(p) for p in sorted(folder.glob("*/trace.jsonl"))]
    return [s for s in sessions if s.turns]


@dataclass(frozen=True, slots=True)
class Program:
    name: str
    session: Session
    start_s: float
    ident: int

    def own_ids(self) -> list[int]:
        longest = max(t.prompt_tokens for t in self.session.turns)
        rng = random.Random(self.ident)
        return [rng.randrange(1, VOCAB) for _ in range(max(longest - SHARED_TOKENS, 0))]


def shared_ids() -> list[int]:
    rng = random.Random(-1)
    return [rng.randrange(1, VOCAB) for _ in range(SHARED_TOKENS)]


def programs(sessions: Sequence[Session], count: int, rate_per_s: float, seed: int) -> list[Program]:
    """`count` programs, each a session drawn by `seed`, starting as a Poisson process of `rate_per_s`."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    for i in range(count):
        t += rng.expovariate(rate_per_s)
        out.append(Program(f"s{seed}-p{i}", rng.choice(sessions), round(t, 3), seed * 100_000 + i))
    return out


def background(duration_s: float, rate_per_s: float, seed: int) -> list[float]:
    """Arrival times of unrelated one-shot requests (a Poisson process)."""
    rng = random.Random(seed + 7_777)
    out: list[float] = []
    t = rng.expovariate(rate_per_s) if rate_per_s > 0 else duration_s
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out

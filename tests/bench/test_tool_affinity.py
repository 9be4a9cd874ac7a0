"""The tool-affinity benchmark's parts on a made-up trace: sessions, the in-process pool, one replay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.tool_affinity.run import _parser, replay, summarize
from bench.tool_affinity.workload import SHARED_TOKENS, load_sessions, programs


def trace(folder: Path, name: str, turns: list[tuple[int, int, str, float]]) -> None:
    rows: list[dict[str, Any]] = [
        {
            "status": "success",
            "prompt_tokens": 8,
            "completion_tokens": 1,
            "timestamp": "2026-01-01T00:00:00+00:00",
            "response": "Choices(finish_reason='length')",
        }
    ]
    at = 1.0
    for prompt, output, finish, gap in turns:
        stamp = f"2026-01-01T00:00:{at:06.3f}+00:00"
        rows.append({"status": "success", "prompt_tokens": prompt, "completion_tokens": output, "timestamp": stamp,
                     "response": f"Choices(finish_reason='{finish}', index=0)"})  # fmt: skip
        at += gap
    (folder / name).mkdir(parents=True)
    (folder / name / "trace.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_sessions_keep_finish_reasons_and_gaps(tmp_path: Path) -> None:
    trace(tmp_path, "a", [(5300, 90, "tool_calls", 2.5), (5900, 120, "stop", 4.0), (7000, 200, "stop", 0.0)])
    (session,) = load_sessions(tmp_path)
    assert [t.tool_calls for t in session.turns] == [True, False, False]  # the health check left out
    assert [round(t.gap_s, 3) for t in session.turns] == [2.5, 4.0, 0.0]
    batch = programs([session], 3, rate_per_s=1.0, seed=1)
    assert batch == programs([session], 3, rate_per_s=1.0, seed=1)  # seeded
    own = batch[0].own_ids()
    assert len(own) == 7000 - SHARED_TOKENS and own != batch[1].own_ids()


@pytest.mark.slow
def test_a_replay_keeps_returns_on_their_holder_with_the_scorer(tmp_path: Path) -> None:
    turns = [(5300 + 400 * i, 60, "tool_calls" if i % 2 == 0 else "stop", 1.5) for i in range(6)]
    trace(tmp_path, "a", turns)
    sessions = load_sessions(tmp_path)
    args = _parser().parse_args(["--kv-blocks", "3000", "--background-rps", "1", "--max-num-seqs", "16"])
    progs = programs(sessions, 16, rate_per_s=2.0, seed=1)
    runs = {variant: replay(variant, 1, args, progs) for variant in ("default", "tool-affinity")}
    for run in runs.values():
        assert summarize(run)["after_tool_turns"] == 16 * 3  # every program ran every turn
    assert summarize(runs["tool-affinity"])["same_endpoint_after_tool"] >= 90.0
    reasons = {v: [t["reason"] for t in run["turns"] if t["after_tool_call"]] for v, run in runs.items()}
    assert "tool-return" not in reasons["default"]
    assert reasons["tool-affinity"].count("tool-return") >= len(reasons["tool-affinity"]) // 2


@pytest.mark.slow
def test_with_a_dram_tier_every_turn_runs_and_finds_more_cached(tmp_path: Path) -> None:
    """Prefixes loaded back from host DRAM wake their replica when they land (no turn is left waiting),
    and a history evicted from HBM during a tool run is found there on the way back."""
    turns = [(5300 + 400 * i, 60, "tool_calls" if i % 2 == 0 else "stop", 1.5) for i in range(6)]
    trace(tmp_path, "a", turns)
    progs = programs(load_sessions(tmp_path), 16, rate_per_s=2.0, seed=1)
    base = ["--kv-blocks", "1200", "--background-rps", "2", "--max-num-seqs", "16"]
    without = summarize(replay("default", 1, _parser().parse_args(base), progs))
    with_dram = summarize(replay("default", 1, _parser().parse_args([*base, "--offload-blocks", "8000"]), progs))
    assert with_dram["after_tool_turns"] == without["after_tool_turns"] == 16 * 3
    assert with_dram["hit_after_tool"] > without["hit_after_tool"]

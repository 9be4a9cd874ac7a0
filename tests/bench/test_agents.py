"""The agents benchmark's pure parts on a made-up trace: sessions, programs, prompts, the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.agents.report import critical, slowdowns, summarize, write
from bench.agents.workload import SHARED_BLOCKS, load_sessions, programs
from bench.replay.workload import BLOCK_TOKENS, PromptBuilder


def trace(folder: Path, name: str, turns: list[tuple[int, int]]) -> None:
    rows: list[dict[str, Any]] = [{"status": "success", "prompt_tokens": 8, "completion_tokens": 1}]  # "hi"
    rows += [{"status": "success", "prompt_tokens": p, "completion_tokens": c} for p, c in turns]
    (folder / name).mkdir(parents=True)
    (folder / name / "trace.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_sessions_become_programs_whose_turns_extend_each_other(tmp_path: Path) -> None:
    trace(tmp_path, "a", [(5300, 90), (5900, 120), (7000, 200)])
    trace(tmp_path, "b", [(5250, 80), (5400, 100)])
    sessions = load_sessions(tmp_path)
    assert [len(s.turns) for s in sessions] == [3, 2]  # the health check left out
    batch = programs(sessions, [(40, 1), (1, 2)], seed=3, stagger_s=8.0)
    assert [p.width for p in batch] == [40, 1, 1]
    assert batch[0].start_s == 0.0 and all(0.0 < p.start_s <= 8.0 for p in batch[1:])
    assert batch == programs(sessions, [(40, 1), (1, 2)], seed=3, stagger_s=8.0)  # seeded
    wide = batch[0]
    first, second = wide.block_ids(0, 5300), wide.block_ids(0, 5900)
    assert second[: len(first)] == first and first[:SHARED_BLOCKS] == tuple(range(SHARED_BLOCKS))
    assert not set(wide.block_ids(1, 5900)[SHARED_BLOCKS:]) & set(second[SHARED_BLOCKS:])  # branches apart
    other_seed = programs(sessions, [(40, 1), (1, 2)], seed=4, stagger_s=8.0)[0]
    assert not set(other_seed.block_ids(0, 5900)[SHARED_BLOCKS:]) & set(second[SHARED_BLOCKS:])
    builder = PromptBuilder(1)
    turn0, turn1 = wide.prompt(builder, 0, 0), wide.prompt(builder, 0, 1)
    assert turn1.startswith(turn0[: len(turn0) // 2]) and len(turn1) > len(turn0)
    assert len(first) == -(-5300 // BLOCK_TOKENS)


def program(name: str, width: int, completion_s: float, waits: list[float], engine: list[float]) -> dict[str, Any]:
    calls = [[t, 0, 0.0, 1.0, 200, "", w, 10, 0, e] for t, (w, e) in enumerate(zip(waits, engine, strict=True))]
    return {"name": name, "width": width, "session": "a", "start_s": 0.0, "completion_s": completion_s,
            "calls": calls, "ok": True}  # fmt: skip


@pytest.mark.slow
def test_the_report_divides_by_the_solo_run_and_splits_waiting_from_engine_time(tmp_path: Path) -> None:
    raw: dict[str, Any] = {
        "args": {"seeds": "1", "time_scale": 1.0, "tool_s": 0.2, "stagger_s": 8.0, "quick": False},
        "machine": "test",
        "pool": {"engines": 2, "max_num_seqs": 8, "preset": "llama-3.1-8b@h100"},
        "widths": [[40, 1], [1, 1]],
        "runs": {
            "solo": {"1": [program("w", 40, 20.0, [0, 0], [5, 5]), program("s", 1, 4.0, [0, 0], [2, 2])]},
            "request": {"1": [program("w", 40, 22.0, [0, 0], [5, 6]), program("s", 1, 12.0, [4000, 2000], [3, 3])]},
            "program": {"1": [program("w", 40, 24.0, [0, 0], [6, 6]), program("s", 1, 5.0, [0, 500], [2, 2.5])]},
        },
    }
    assert slowdowns(raw, "request") == {40: [1.1], 1: [3.0]}
    assert critical(raw["runs"]["request"]["1"][1]["calls"], 6) == 6000.0
    summary = summarize(raw)
    assert summary["program"][1]["p99"] == 1.25 and summary["request"][1]["wait_share"] == 0.5
    assert summary["program"][1]["engine_p50"] == 1.125
    out = tmp_path / "agents.md"
    write(raw, out)
    text = out.read_text()
    assert "meets the 1.5x target" in text and "misses the 1.5x target" in text
    assert (tmp_path / "agents.png").stat().st_size > 0

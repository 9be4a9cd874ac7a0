"""The runaway guard (policies/program.py): the same last turn too many times in a row is refused."""

from __future__ import annotations

from typing import Any

from policies.program import RunawayGuard, prompt_suffix


def turn(history: int, result: str, call_id: str) -> dict[str, Any]:
    """A chat body after `history` steps whose last message is a tool result under a fresh call id."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"step {i}"} for i in range(history)]
    messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return {"model": "m", "messages": messages}


def test_suffix_ignores_history_and_minted_ids() -> None:
    assert prompt_suffix(turn(1, "same", "call_a")) == prompt_suffix(turn(9, "same", "call_b"))
    assert prompt_suffix(turn(1, "same", "call_a")) != prompt_suffix(turn(1, "other", "call_a"))
    anthropic = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}
    again = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}
    assert prompt_suffix({"messages": [anthropic]}) == prompt_suffix({"messages": [again]})


def test_suffix_of_each_api_shape() -> None:
    assert prompt_suffix({"input": "hi"}) == prompt_suffix({"prompt": "hi"})  # Responses text, completions
    assert prompt_suffix({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}) is not None
    assert prompt_suffix({"messages": []}) is None
    assert prompt_suffix({"input": 3}) is None


def test_refused_after_the_limit_and_counted_again_on_a_new_turn() -> None:
    guard = RunawayGuard()
    verdicts = [guard.check("t1", "p", turn(i, "same", f"c{i}"), max_repeats=3) for i in range(5)]
    assert [v is None for v in verdicts] == [True, True, True, False, False]  # stays stopped while it loops
    rejection = verdicts[3]
    assert rejection is not None
    assert (rejection.status, rejection.code, rejection.reason) == (429, "program_loop", "program_loop")
    assert "program_max_repeats" in rejection.message and "'p'" in rejection.message
    assert guard.check("t1", "p", turn(6, "different", "c6"), max_repeats=3) is None  # changed course
    assert guard.check("t1", "other", turn(1, "same", "c7"), max_repeats=3) is None  # programs apart
    assert guard.check("t2", "p", turn(1, "same", "c8"), max_repeats=1) is None  # tenants apart


def test_state_is_bounded_per_tenant_least_recent_forgotten() -> None:
    guard = RunawayGuard(max_programs=3)
    for i in range(10):
        guard.check("t1", f"p{i}", turn(1, "x", "c"), max_repeats=5)
    assert guard.programs("t1") == 3
    # p0 was forgotten: its count starts again, so two more of the same turn pass a limit of 2
    assert guard.check("t1", "p0", turn(1, "x", "c"), max_repeats=2) is None
    assert guard.check("t1", "p0", turn(1, "x", "c"), max_repeats=2) is None
    assert guard.check("t1", "p0", turn(1, "x", "c"), max_repeats=2) is not None


def test_a_cycle_of_different_turns_is_a_loop_too() -> None:
    # read, edit, test, read, edit, test, ...: no turn repeats twice in a row, the cycle does
    guard = RunawayGuard()
    cycle = ["read file", "edit file", "run tests"]
    verdicts = [guard.check("t", "p", turn(i, cycle[i % 3], f"c{i}"), max_repeats=2, max_cycle=4) for i in range(10)]
    assert [v is None for v in verdicts] == [True] * 8 + [False, False]  # the call closing a third round is refused
    rejection = verdicts[8]
    assert rejection is not None and rejection.code == "program_loop"
    assert "cycle of 3 turns 3 times" in rejection.message and "program_max_cycle" in rejection.message


def test_cycles_longer_than_the_setting_are_not_counted() -> None:
    guard = RunawayGuard()
    cycle = ["a", "b", "c"]
    verdicts = [guard.check("t", "p", turn(i, cycle[i % 3], f"c{i}"), max_repeats=2, max_cycle=2) for i in range(9)]
    assert all(v is None for v in verdicts)


def test_a_broken_cycle_starts_the_count_again() -> None:
    guard = RunawayGuard()
    turns = ["a", "b", "a", "b", "x", "a", "b", "a", "b"]
    verdicts = [
        guard.check("t", "p", turn(i, text, f"c{i}"), max_repeats=2, max_cycle=4) for i, text in enumerate(turns)
    ]
    assert all(v is None for v in verdicts)  # two rounds, a detour, two rounds: never a third in a row
    assert guard.check("t", "p", turn(9, "a", "c9"), max_repeats=2, max_cycle=4) is None
    assert guard.check("t", "p", turn(10, "b", "c10"), max_repeats=2, max_cycle=4) is not None

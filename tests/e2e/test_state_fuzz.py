"""What Redis holds is input too: the chaos suite's shared-state fuzz (`bench/chaos/state_fuzz.py`) in
the suite, smaller. Two gateways share one Redis while keys they wrote are corrupted between requests
(deleted, replaced by another type, set to garbage): no request meets a bug, every generating request
is recorded exactly once, the limiter's breaker never trips, and both gateways serve again and read
each other's reports, with the garbage left in place and after it is deleted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import state_fuzz

pytestmark = [pytest.mark.e2e, pytest.mark.redis]


def test_whatever_the_shared_state_holds_no_request_meets_a_bug_and_the_replicas_heal(tmp_path: Path) -> None:
    result = state_fuzz.run(tmp_path, examples=300)
    assert result["keys_corrupted"] >= 10, result  # the draw reached many of the keys, not one
    assert state_fuzz.met(result), "\n".join(state_fuzz.section(result))

"""The endpoint picker's own surface under the chaos suite's stream fuzz (`bench/chaos/epp_fuzz.py`):
ext_proc streams of any messages in any order against `tokenway epp` over simulated engines. The
picker never fails a stream, records every request at most once and every pick exactly once, and
holds nothing afterwards. A smaller run of the same probe as `python -m bench.chaos --only epp_fuzz`
(the same derandomized examples, fewer of them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import epp_fuzz

pytestmark = pytest.mark.e2e


def test_hostile_ext_proc_streams_fail_nothing_and_leak_nothing(tmp_path: Path) -> None:
    result = epp_fuzz.run(tmp_path, examples=600)
    assert result["picked"] > 50, result  # the examples reach the walk, not only its refusals
    assert epp_fuzz.met(result), "\n".join(epp_fuzz.section(result))

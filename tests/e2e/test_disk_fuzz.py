"""What the disk holds is input too: the chaos suite's disk fuzz (`bench/chaos/disk_fuzz.py`) in the
suite, smaller. One gateway is stopped (a clean stop and a crash in turn) before each example, 1-3 of
its files damaged (the ledger, the audit log, the key store, the batch store's records, bytes,
indexes and result logs) and started again: it starts every time but for a key store SQLite cannot
read (one line naming the file, then the operator's backup is put back), no request meets a bug,
every chat request is recorded once but for the lines the damage took, keys made through the admin
API survive every damage but the key store's, and lines of 48 MiB do not reach memory whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import disk_fuzz

pytestmark = [pytest.mark.e2e]


def test_whatever_the_disk_holds_the_gateway_starts_and_no_request_meets_a_bug(tmp_path: Path) -> None:
    result = disk_fuzz.run(tmp_path, examples=12)
    assert len(result["damaged_kinds"]) >= 4, result  # the draw reached many kinds of file, not one
    assert disk_fuzz.met(result), "\n".join(disk_fuzz.section(result))

"""What an engine reports on its side channels is input too: the chaos suite's engine-channels fuzz
(`bench/chaos/engine_channels.py`) in the suite, smaller. A stand-in engine answers chat requests
correctly while its KV events (and replay socket), `/metrics`, `/v1/models` and `/tokenize` report
drawn, hostile content: every request is answered without a 5xx and recorded exactly once, nothing
is held after, the log shows no bug, the endpoint's stats stay finite and in range, and afterwards
each reader (the KV subscriber, the scraper, the LoRA discovery) still applies a valid report."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import engine_channels

pytestmark = pytest.mark.e2e


def test_whatever_an_engine_reports_requests_are_served_and_every_reader_survives(tmp_path: Path) -> None:
    result = engine_channels.run(tmp_path, examples=300)
    assert result["statuses"].get(200, 0) > 200, result  # the requests were served, not only refused
    assert result["kv_messages"] > result["kv_valid"] > 100, result  # both kinds of message were sent
    assert result["kv_subscription"]["decode_errors"] > 0, result  # ... and the garbage reached the decoder
    assert engine_channels.met(result), "\n".join(engine_channels.section(result))

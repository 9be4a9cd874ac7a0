"""Pool config extensions: per-engine defaults filled in, settings defaults from the engines' source."""

from __future__ import annotations

import pytest

from backends.config import BackendsSettings
from tests.backends.builders import pool


@pytest.mark.parametrize(
    ("engine", "block_size", "ready_timeout_s"),
    [("vllm", None, 1200.0), ("trtllm", 32, 1800.0), ("vllm-ascend", None, 1800.0), ("sim", 16, 120.0)],
)
def test_engine_defaults(engine: str, block_size: int | None, ready_timeout_s: float) -> None:
    p = pool(engine=engine)
    assert (p.block_size, p.ready_timeout_s) == (block_size, ready_timeout_s)


def test_explicit_values_win() -> None:
    p = pool(engine="vllm-ascend", block_size=32, ready_timeout_s=5)
    assert (p.block_size, p.ready_timeout_s) == (32, 5)


def test_settings_defaults() -> None:
    s = BackendsSettings()
    assert s.scrape_interval_s == 0.25
    assert s.log_dir == "var/log/engines"
    assert s.devices == "auto"

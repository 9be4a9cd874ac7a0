from __future__ import annotations

from pathlib import Path

import pytest

from gateway.ledger import codec
from gateway.ledger.plot import choose_bucket_s, plot_spend
from tests.gateway.ledger.records import make_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_spend_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    entries = [codec.decode(codec.encode(make_record(i, started_at_unix_s=1_750_000_000 + i * 30))) for i in range(300)]
    out = plot_spend(entries, ["tenant"], tmp_path / "spend.png", top=2)
    assert out.read_bytes()[:8] == PNG_MAGIC
    empty = plot_spend([], ["tenant"], tmp_path / "empty.png")
    assert empty.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("span_s", "bucket_s"),
    [
        pytest.param(600, 60, id="10min"),
        pytest.param(86400, 3600, id="1day"),
        pytest.param(90 * 86400, 86400, id="90days"),
    ],
)
def test_bucket_keeps_about_sixty_points(span_s: int, bucket_s: int) -> None:
    assert choose_bucket_s(span_s) == bucket_s

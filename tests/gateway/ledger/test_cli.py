from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from gateway.app.settings import LedgerConfig
from gateway.ledger.cli import main, parse_time_s
from gateway.ledger.writer import LedgerWriter
from policies.types import parse_duration_s
from tests.gateway.ledger.records import make_record


@pytest.fixture
def ledger_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "usage"
    writer = LedgerWriter(LedgerConfig(dir=str(directory)))
    now = time.time()
    for i in range(60):
        writer.append(make_record(i, started_at_unix_s=now - 3600))  # an hour ago
    for i in range(60, 70):
        writer.append(make_record(i, started_at_unix_s=now - 3 * 86400))  # three days ago
    writer.close_sync()
    return directory


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("24h", 86400), ("7d", 604800), ("2w", 1209600), ("1.5h", 5400)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


def test_times() -> None:
    assert parse_time_s("2025-01-01", 0) == 1735689600
    assert parse_time_s("2025-01-01T01:00:00Z", 0) == 1735693200
    assert parse_time_s("1h", 10_000) == 6400
    with pytest.raises(ValueError, match="not a duration"):
        parse_time_s("yesterday", 0)


def test_report_json_over_the_window(ledger_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", "report", "--dir", str(ledger_dir), "--since", "24h", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["by"] == ["tenant", "model"]
    assert doc["total"]["requests"] == 60
    assert (
        main(["usage", "report", "--dir", str(ledger_dir), "--since", "7d", "--by", "tenant", "--format", "json"]) == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["total"]["requests"] == 70 and len(doc["groups"]) == 3


@pytest.mark.slow
def test_report_table_and_plot(ledger_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "spend.png"
    assert main(["usage", "report", "--dir", str(ledger_dir), "--by", "model", "--plot", str(png)]) == 0
    out = capsys.readouterr()
    assert "TOTAL" in out.out and "llama-3.1-8b" in out.out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_relative_ledger_dir_is_relative_to_the_working_directory_as_the_gateway_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make run` (config/gateway.yaml from the repository root) and the Docker image (config in
    /etc/tokenway, working directory /var/lib/tokenway) write the ledger relative to the working
    directory; the report, given the same gateway.yaml from the same place, reads it there."""
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "config"
    conf.mkdir()
    config = conf / "gateway.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": 8080}, "ledger": {"dir": "var/usage"}}))
    from gateway.app.settings import load_settings

    writer = LedgerWriter(load_settings(str(config)).ledger)  # what the gateway does with ledger.dir
    writer.append(make_record(0, started_at_unix_s=time.time() - 60))
    writer.close_sync()
    assert (tmp_path / "var" / "usage").is_dir() and not (conf / "var").exists()
    assert main(["usage", "report", "--config", str(config), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("TOTAL,,1,")
    monkeypatch.chdir(conf)  # elsewhere: the message says where it looked and by which rule
    assert main(["usage", "report", "--config", "gateway.yaml"]) == 1
    err = capsys.readouterr().err
    assert f"no ledger directory var/usage ({conf / 'var' / 'usage'}" in err and "working directory" in err
    config.write_text(yaml.safe_dump({"ledger": {"commit_interval_ms": "soon"}}))
    assert main(["usage", "report", "--config", str(config)]) == 2
    assert "commit_interval_ms" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        pytest.param(["--since", "yesterday"], 2, "not a duration", id="bad-since"),
        pytest.param(["--by", "prompt"], 2, "cannot group by", id="bad-field"),
    ],
)
def test_errors_exit_nonzero_with_a_message(
    ledger_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], status: int, message: str
) -> None:
    assert main(["usage", "report", "--dir", str(ledger_dir), *args]) == status
    assert message in capsys.readouterr().err


def test_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", "report", "--dir", str(tmp_path / "nope")]) == 1
    assert "no ledger directory" in capsys.readouterr().err

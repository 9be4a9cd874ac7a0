"""`tokenway usage sql` end to end: a real gateway writes its ledger (and, configured, a PostgreSQL
table); the SQL totals equal `tokenway usage report`'s, from the embedded store and from PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.polling import wait_for
from tests.support.procs import REPO, TEST_KEY, Gateway, SimEngines, policies_doc, static_pool

pytestmark = pytest.mark.e2e

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count my tokens."}]
MODELS = {"llama-3.1-8b": {"price": {"input_per_mtok": 2.0, "output_per_mtok": 8.0}}}
SQL = (
    "SELECT tenant, model, count(*) AS requests, sum(input_tokens) AS input_tokens,"
    " sum(output_tokens) AS output_tokens, sum(cost_usd) AS cost_usd FROM {table} GROUP BY 1, 2"
)


def tokenway(*argv: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "usage", *argv], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def traffic(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    for i in range(6):
        client.chat.completions.create(model="llama-3.1-8b", messages=MESSAGES, max_tokens=3 + i)
    list(client.chat.completions.create(model="llama-3.1-8b", messages=MESSAGES, max_tokens=4, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


def assert_same_totals(sql_rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    by_group = {(r["tenant"], r["model"] or ""): r for r in sql_rows}
    assert len(by_group) == len(report["groups"])
    for group in report["groups"]:
        row = by_group[(group["tenant"], group["model"])]
        for field in ("requests", "input_tokens", "output_tokens"):
            assert (row[field] or 0) == group[field], field
        assert (row["cost_usd"] or 0) == pytest.approx(group["cost_usd"])
    assert sum(r["requests"] for r in sql_rows) == report["total"]["requests"] == 8


def test_sql_over_the_ledger_equals_the_report(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b")
    usage_dir = tmp_path / "usage"
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(models=MODELS),
        ledger={"dir": str(usage_dir), "commit_interval_ms": 20},
    )
    traffic(gateway)
    query = SQL.format(table="usage")
    # while the gateway runs: the active file is loaded as far as it is written
    wait_for(
        lambda: sum(r["requests"] for r in tokenway("sql", query, "--dir", str(usage_dir), "--format", "json")) == 8,
        timeout_s=30,
        what="the 8 records in the SQL store",
    )
    assert gateway.stop() == 0
    rows = tokenway("sql", query, "--dir", str(usage_dir), "--format", "json")
    report = tokenway("report", "--dir", str(usage_dir), "--since", "1h", "--by", "tenant,model", "--format", "json")
    assert_same_totals(rows, report)
    assert (usage_dir / "usage.sqlite").is_file()


def test_postgres_sink_equals_the_report(
    sim_factory: Callable[..., SimEngines],
    gateway_factory: Callable[..., Gateway],
    tmp_path: Path,
    postgres_dsn: str,
) -> None:
    engines = sim_factory(count=1, served_model_name="llama-3.1-8b")
    usage_dir = tmp_path / "usage"
    table = f"usage_{uuid.uuid4().hex[:10]}"
    gateway = gateway_factory(
        pools=[static_pool("llama", "llama-3.1-8b", engines.urls)],
        policies=policies_doc(models=MODELS),
        ledger={"dir": str(usage_dir), "postgres": {"dsn": postgres_dsn, "table": table}},
    )
    traffic(gateway)
    assert gateway.stop() == 0  # the sink sends what is queued before the process ends
    rows = tokenway("sql", SQL.format(table=table), "--dsn", postgres_dsn, "--format", "json")
    report = tokenway("report", "--dir", str(usage_dir), "--since", "1h", "--by", "tenant,model", "--format", "json")
    assert_same_totals(rows, report)

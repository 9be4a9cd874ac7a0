"""The console's key and tenant lists in Debian's headless Chromium: each key's and tenant's team and
spend today and this month (a key's from the admission store, a tenant's own from the ledger), the
search and status filters, and the keys and usage tables exported as CSV files (a real download)."""

from __future__ import annotations

import csv
import io
import json
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from policies.policy import hash_key
from tests.e2e.test_console import by_css, page_ready, wait
from tests.support.browser import chromium, require_browser
from tests.support.procs import OTHER_KEY, TEST_KEY, Gateway, SimEngines, policies_doc, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LLAMA = "llama-3.1-8b"
TOKEN = "console-lists-admin-token"


def admin_get(gateway: Gateway, path: str) -> Any:
    request = urllib.request.Request(gateway.url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def log_in(driver: Any, gateway: Gateway) -> None:
    driver.get(gateway.url + "/ui")
    wait(driver, by_css("#token")).send_keys(TOKEN)
    wait(driver, by_css("#login-submit")).click()
    wait(driver, by_css("#nav"))


def rows_of(driver: Any, table_id: str) -> list[str]:
    script = f"return [...document.querySelectorAll('#{table_id} tbody tr')].map((r) => r.dataset.id);"
    return list(driver.execute_script(script))


def downloaded(folder: Path, prefix: str, timeout_s: float = 20.0) -> list[dict[str, str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [p for p in folder.glob(f"{prefix}*.csv")]
        if found:
            return list(csv.DictReader(io.StringIO(found[0].read_text(encoding="utf-8"))))
        assert time.monotonic() < deadline, f"no {prefix}*.csv in {sorted(folder.iterdir())}"
        time.sleep(0.1)


def test_key_and_tenant_lists_show_team_and_spend_filter_and_export(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    require_browser()
    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    policy = policies_doc(
        models={LLAMA: {"price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}},
        teams={"search": {}},
        tenants={"t1": {"team": "search"}, "t2": {}},
        keys=[
            {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
            {"id": "k2", "tenant": "t2", "sha256": hash_key(OTHER_KEY)},
        ],
        admission={"track_key_spend": True},
    )
    gateway = gateway_factory(
        pools=[static_pool("p", LLAMA, engines.urls)], policies=policy, server={"admin_token": TOKEN}
    )
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    assert client.chat.completions.create(model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=8)

    def spent() -> dict[str, Any]:
        return {k["id"]: k for k in admin_get(gateway, "/admin/keys?spend=1")["data"]}

    deadline = time.monotonic() + 30
    while not (spent()["k1"]["spend_usd"]["day"] or 0) > 0:  # settled after the answer
        assert time.monotonic() < deadline, spent()
        time.sleep(0.2)
    keys = spent()
    assert keys["k1"]["team"] == "search" and keys["k2"]["team"] is None
    assert keys["k1"]["spend_usd"]["month"] == keys["k1"]["spend_usd"]["day"]
    assert keys["k2"]["spend_usd"] == {"day": 0.0, "month": 0.0}
    assert "spend_usd" not in admin_get(gateway, "/admin/keys")["data"][0]  # read only when asked

    def tenants_spent() -> dict[str, Any]:
        return {t["name"]: t for t in admin_get(gateway, "/admin/tenants?spend=1")["data"]}

    # the tenants' figures come from the ledger and are kept for a while (`tenant_spend.TTL_S`): ask
    # once the request's record is written, so the first figure is already the whole one
    ledger = gateway.workdir / "var" / "usage"
    while not any(path.stat().st_size for path in ledger.glob("*.jsonl")):
        assert time.monotonic() < deadline, "no ledger record"
        time.sleep(0.05)

    while not tenants_spent()["t1"]["spend_usd"]["day"]:  # the tenant's own figure: from the ledger, once written
        assert time.monotonic() < deadline + 30, tenants_spent()
        time.sleep(0.5)
    tenants = tenants_spent()
    assert tenants["t1"]["team"] == "search" and tenants["t1"]["spend_source"]["source"] == "ledger-files"
    assert tenants["t1"]["spend_usd"] == pytest.approx(keys["k1"]["spend_usd"], abs=1e-6)  # what admission charged
    assert tenants["t2"]["spend_usd"] == {"day": 0.0, "month": 0.0}

    folder = Path(tempfile.mkdtemp(prefix="tokenway-csv-"))
    with chromium() as driver:
        driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(folder)})
        log_in(driver, gateway)
        driver.get(gateway.url + "/ui#keys")
        wait(driver, page_ready("keys"))
        row = wait(driver, by_css('#keys-table tr[data-id="k1"]'))
        assert "search" in row.text and f"${keys['k1']['spend_usd']['day']:.6f}" in row.text
        assert rows_of(driver, "keys-table") == ["k1", "k2"]
        wait(driver, by_css("#keys-search")).send_keys("search")  # the team's name finds its key
        wait(driver, lambda d: rows_of(d, "keys-table") == ["k1"])
        wait(driver, by_css("#keys-csv")).click()
        exported = downloaded(folder, "tokenway-keys-")
        assert [r["Id"] for r in exported] == ["k1"]
        assert exported[0]["Team"] == "search" and float(exported[0]["Spend today"]) == keys["k1"]["spend_usd"]["day"]
        driver.find_element("id", "keys-search").clear()
        driver.execute_script("document.getElementById('keys-search').dispatchEvent(new Event('input'))")
        wait(driver, lambda d: rows_of(d, "keys-table") == ["k1", "k2"])
        pick = "const s = document.getElementById('keys-status'); s.value = 'revoked';"
        driver.execute_script(pick + " s.dispatchEvent(new Event('change'));")
        wait(driver, lambda d: rows_of(d, "keys-table") == [])

        driver.get(gateway.url + "/ui#tenants")
        wait(driver, page_ready("tenants"))
        row = wait(driver, by_css('#tenants-table tr[data-id="t1"]'))
        assert "search" in row.text and f"${keys['k1']['spend_usd']['day']:.6f}" in row.text
        wait(driver, by_css("#tenants-search")).send_keys("t2")
        wait(driver, lambda d: rows_of(d, "tenants-table") == ["t2"])

        driver.get(gateway.url + "/ui#usage")
        wait(driver, page_ready("usage"))
        wait(driver, by_css("#usage-table"))
        wait(driver, by_css("#usage-csv")).click()
        usage = downloaded(folder, "tokenway-usage-")
        assert usage[-1]["tenant"] == "TOTAL" and int(usage[-1]["requests"]) >= 1  # GET /admin/usage?format=csv

        # by pool: each pool's share of the range's tokens and dollars (what spilled to an overflow pool)
        driver.execute_script("document.getElementById('usage-by').value = 'pool';")
        wait(driver, by_css("#usage-go")).click()
        # read through the page's script: the table is replaced when the report arrives (no stale element)
        table_text = "const t = document.getElementById('usage-table'); return t ? t.innerText : '';"
        wait(driver, lambda d: "Token share" in d.execute_script(table_text))
        assert "100.0 %" in driver.execute_script(table_text)  # the total row: all of it

"""The console's per-model charts, "Test this model" and its one time format, in Debian's headless
Chromium: the overview draws latency and errors per model from each minute's per-model counters; the
Pools page's check runs one max_tokens=1 request through the gateway as the admin's own `check:` key
(never a customer's), shown with its latency, in the live tail, the ledger's records and the audit log;
every time shown reads YYYY-MM-DD HH:MM:SS (UTC)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.e2e.test_console import by_css, page_ready, wait
from tests.support.browser import chromium, require_browser
from tests.support.procs import TEST_KEY, Gateway, SimEngines, policies_doc, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LLAMA = "llama-3.1-8b"
TOKEN = "console-models-admin-token"
STAMP = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}$")


def admin_call(gateway: Gateway, method: str, path: str) -> tuple[int, Any]:
    request = urllib.request.Request(
        gateway.url + path, method=method, data=b"" if method == "POST" else None,
        headers={"Authorization": f"Bearer {TOKEN}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=40) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def texts(driver: Any, selector: str) -> list[str]:
    return list(
        driver.execute_script(f"return [...document.querySelectorAll({selector!r})].map((e) => e.textContent);")
    )


def test_model_charts_model_check_and_one_time_format(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    require_browser()
    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    policy = policies_doc(
        models={LLAMA: {"price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}},
        admission={"track_key_spend": True},
    )
    gateway = gateway_factory(
        pools=[static_pool("p", LLAMA, engines.urls)], policies=policy, server={"admin_token": TOKEN}
    )
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    hi: Any = [{"role": "user", "content": "hi"}]
    assert client.chat.completions.create(model=LLAMA, messages=hi, max_tokens=4)
    for _ in client.chat.completions.create(model=LLAMA, messages=hi, max_tokens=4, stream=True):
        pass
    minutes = admin_call(gateway, "GET", "/admin/activity")[1]["minutes"]
    counted = sum((m["models"].get(LLAMA) or {}).get("requests", 0) for m in minutes)
    streamed = sum((m["models"].get(LLAMA) or {}).get("ttft_n", 0) for m in minutes)
    assert counted == 2 and streamed == 1

    def k1_spend() -> Any:
        return next(k for k in admin_call(gateway, "GET", "/admin/keys?spend=1")[1]["data"] if k["id"] == "k1")[
            "spend_usd"
        ]

    deadline = time.monotonic() + 30
    while not (k1_spend()["day"] or 0) > 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    before = k1_spend()
    assert admin_call(gateway, "POST", "/admin/models/no-such-model/check")[0] == 404

    with chromium() as driver:
        driver.get(gateway.url + "/ui")
        wait(driver, by_css("#token")).send_keys(TOKEN)
        wait(driver, by_css("#login-submit")).click()
        wait(driver, by_css("#nav"))

        wait(driver, page_ready("overview"))
        wait(driver, lambda d: d.find_element("id", "chart-model-latency").get_attribute("data-models") == LLAMA)
        legend = " ".join(texts(driver, "#chart-model-latency .u-legend"))
        assert f"{LLAMA} mean" in legend and f"{LLAMA} TTFT p90" in legend
        assert LLAMA in " ".join(texts(driver, "#chart-model-errors .u-legend"))

        driver.get(gateway.url + "/ui#pools")
        wait(driver, page_ready("pools"))
        wait(driver, by_css(f'button[data-action="check"][data-model="{LLAMA}"]')).click()
        shown = wait(driver, lambda d: next((t for t in texts(d, ".check-result") if " ms" in t), False), 40)
        assert "ok" in shown and "200 in" in shown and "UTC" in shown, shown

        driver.get(gateway.url + "/ui#tail")
        wait(driver, page_ready("tail"))
        wait(driver, by_css("#tail-table tbody tr"))
        rows = texts(driver, "#tail-table tbody tr")
        assert "@check" in rows[0] and "check:console" in rows[0], rows[0]
        assert texts(driver, "#tail-table th")[0] == "Time (UTC)"
        assert all(STAMP.match(t) for t in texts(driver, "#tail-table tbody td:first-child"))

        driver.get(gateway.url + "/ui#audit")
        wait(driver, page_ready("audit"))
        rows = texts(driver, "#audit-table tbody tr")
        assert any("POST /admin/models/{model}/check" in r and LLAMA in r for r in rows), rows
        assert all(STAMP.match(t) for t in texts(driver, "#audit-table tbody td:first-child"))
    assert k1_spend() == before  # the check billed no customer key

"""Screenshots of every console page for docs/console.md, from a real gateway with real traffic.

Starts simulated engines and a gateway (admin token set), makes tenants and keys through the admin
API, sends a few minutes' worth of mixed traffic through the openai client (some of it over a small
limit, so rejections and fallbacks show), then logs in with headless Chromium and saves one PNG per
page under docs/console/.

    .venv/bin/python -m tests.support.console_screenshots [--out docs/console]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai

from tests.support.browser import chromium

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver

from tests.support.procs import REPO, policies_doc, running, start_gateway, start_sim, static_pool

TOKEN = "screenshot-admin-token"
PAGES = ("overview", "keys", "tenants", "usage", "limits", "pools", "predictor", "tail", "audit")
LLAMA, QWEN = "llama-3.1-8b", "qwen2.5-7b"


def admin(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode() if body is not None else None,
        method=method,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def page_ready(name: str) -> Callable[[WebDriver], bool]:
    def ready(driver: WebDriver) -> bool:
        return driver.find_element("id", "page").get_attribute("data-ready") == name

    return ready


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "docs" / "console"))
    parser.add_argument("--requests", type=int, default=240)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tokenway-shots-"))
    # real time (scale 1): the predictor's page shows what it would on real engines
    llama = start_sim(work, count=2, time_scale=1, served_model_name=LLAMA)
    qwen = start_sim(work, count=1, time_scale=1, preset="qwen2.5-7b@h100", served_model_name=QWEN)
    price = {"price": {"input_per_mtok": 0.10, "output_per_mtok": 0.20}}
    models = {
        LLAMA: {**price, "fallbacks": [{"model": QWEN, "triggers": ["rate_limited"]}]},
        QWEN: {"price": {"input_per_mtok": 0.05, "output_per_mtok": 0.10}},
    }
    policy = policies_doc(
        models=models,
        tenants={"platform": {"priority": "high", "slo_class": "interactive"}, "t2": {}},
        keys=[],
        slo_classes={"interactive": {"ttft_ms": 2000, "on_miss": "proceed"}},
    )
    gateway = start_gateway(
        work / "gw",
        pools=[static_pool("llama-8b", LLAMA, llama.urls), static_pool("qwen-7b", QWEN, qwen.urls)],
        policies=policy,
        server={"admin_token": TOKEN},
    )
    with running(llama, qwen, gateway):
        url = gateway.url
        admin(url, "POST", "/admin/tenants", {"name": "acme", "limits": {"tpm": 2000000, "usd_per_day": 50}})
        admin(url, "POST", "/admin/tenants", {"name": "globex", "priority": "low", "models": [LLAMA]})
        made = [
            {"tenant": "acme", "id": "acme-web", "limits": {"rpm": 600}, "metadata": {"owner": "ann", "team": "web"}},
            {"tenant": "acme", "id": "acme-batch", "limits": {"tpm": 30000}, "metadata": {"owner": "bo"}},
            {"tenant": "globex", "id": "globex-trial", "limits": {"rpm": 20, "usd_per_day": 0.5},
             "expires_in": "30d", "metadata": {"owner": "cy", "description": "trial"}},
            {"tenant": "platform", "id": "platform-svc", "metadata": {"team": "platform"}},
        ]  # fmt: skip
        secrets = [admin(url, "POST", "/admin/keys", body)["secret"] for body in made]

        def one(i: int) -> None:
            key = secrets[i % len(secrets)]
            client = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
            model = QWEN if i % 5 == 0 and key != secrets[2] else LLAMA
            words = " ".join(["token"] * (20 + (i * 37) % 400))
            with contextlib.suppress(openai.APIError):  # a refusal is traffic the console shows too
                stream = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"Summarise: {words}"}],
                    max_tokens=16 + i % 48,
                    stream=True,
                )
                deque(stream, maxlen=0)  # read to the end: the request's usage lands in the ledger

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(args.requests)))
        admin(url, "PATCH", "/admin/keys/acme-batch", {"limits": {"tpm": 60000}})  # the audit page's before → after
        time.sleep(2)
        with chromium(1400, 1050) as driver:
            from selenium.webdriver.common.by import By
            from selenium.webdriver.support.ui import WebDriverWait

            driver.get(url + "/ui")
            WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "token").is_displayed())
            driver.find_element(By.ID, "token").send_keys(TOKEN)
            driver.find_element(By.ID, "login-submit").click()
            WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "nav").is_displayed())
            for name in PAGES:
                driver.get(url + f"/ui#{name}")
                WebDriverWait(driver, 30).until(page_ready(name))
                if name == "usage":  # the traffic above spans minutes: show the last hour
                    driver.execute_script("document.getElementById('usage-range').value = '1h';")
                    driver.find_element(By.ID, "usage-go").click()
                if name == "keys":
                    driver.find_element(By.CSS_SELECTOR, 'tr[data-id="acme-web"] a.key-link').click()
                    WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.ID, "key-standing"))
                time.sleep(1.5)  # charts draw after the first poll
                height = int(driver.execute_script("return document.documentElement.scrollHeight"))
                metrics = {
                    "width": 1400,
                    "height": max(700, min(1500, height)),
                    "deviceScaleFactor": 1,
                    "mobile": False,
                }
                driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)  # the whole page, not the window
                time.sleep(0.5)
                driver.save_screenshot(str(out / f"{name}.png"))
                driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
                print(f"wrote {out / f'{name}.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The web console end to end in Debian's headless Chromium: log in with the admin token (which
becomes an HttpOnly, SameSite=Strict cookie and never appears in a URL), create a key, use it with
the openai client, see its spend appear, revoke it, see the next call fail; and every page renders."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.browser import chromium, require_browser
from tests.support.procs import TEST_KEY, Gateway, SimEngines, free_port, policies_doc, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LLAMA = "llama-3.1-8b"
TOKEN = "console-test-admin-token"
COLOUR: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
PAGES = ("overview", "keys", "tenants", "usage", "limits", "pools", "predictor", "tail", "audit")


def wait(driver: Any, condition: Callable[[Any], Any], timeout_s: float = 30.0) -> Any:
    """`condition` polled until truthy; an element that went stale under it (the page navigated or
    re-rendered between finding and reading it) is a "not yet", not a failure."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    ignored = (NoSuchElementException, StaleElementReferenceException)
    return WebDriverWait(driver, timeout_s, poll_frequency=0.1, ignored_exceptions=ignored).until(condition)


def by_css(selector: str) -> Callable[[Any], Any]:
    from selenium.webdriver.common.by import By

    def find(driver: Any) -> Any:
        found = driver.find_elements(By.CSS_SELECTOR, selector)
        return found[0] if found and found[0].is_displayed() else False

    return find


def page_ready(name: str) -> Callable[[Any], bool]:
    def ready(driver: Any) -> bool:
        return bool(driver.find_element("id", "page").get_attribute("data-ready") == name)

    return ready


def test_log_in_make_a_key_use_it_see_its_spend_revoke_it(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    require_browser()
    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    policy = policies_doc(
        models={LLAMA: {"price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}},
        budgets=[{"id": "tenant-daily", "scope": "tenant", "usd_per_day": 100.0}],
    )
    gateway = gateway_factory(
        pools=[static_pool("p", LLAMA, engines.urls)], policies=policy, server={"admin_token": TOKEN}
    )
    with chromium() as driver:
        driver.get(gateway.url + "/ui")
        wait(driver, by_css("#token")).send_keys("wrong")
        wait(driver, by_css("#login-submit")).click()
        assert "wrong admin token" in wait(driver, by_css("#login-error")).text
        wait(driver, by_css("#token")).send_keys(TOKEN)
        wait(driver, by_css("#login-submit")).click()
        wait(driver, by_css("#nav"))
        cookie = wait(driver, lambda d: d.get_cookie("tokenway_console"))  # set by the login answer, read when it lands
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert TOKEN not in driver.current_url and TOKEN not in cookie["value"]
        assert driver.execute_script("return document.cookie") == ""  # invisible to page scripts

        driver.get(gateway.url + "/ui#keys")
        wait(driver, page_ready("keys"))
        wait(driver, by_css("#create-key-id")).send_keys("browser-key")
        wait(driver, by_css("#create-key-rpm")).send_keys("100")
        wait(driver, by_css("#create-key-owner")).send_keys("console-test")
        wait(driver, by_css("#create-key-submit")).click()
        secret = wait(driver, by_css("#new-secret")).text
        assert secret.startswith("tw-")
        wait(driver, by_css('tr[data-id="browser-key"]'))

        client = openai.OpenAI(base_url=gateway.base_url, api_key=secret, max_retries=0)
        reply = client.chat.completions.create(model=LLAMA, messages=COLOUR, max_tokens=8)
        assert reply.choices[0].message.content

        wait(driver, by_css('tr[data-id="browser-key"] a.key-link')).click()
        read_spend = "const e = document.getElementById('key-spend-day'); return e ? e.textContent : null;"
        deadline = time.monotonic() + 30
        while True:  # spend appears once the request is settled; the panel re-renders on each refresh
            spend = driver.execute_script(read_spend)
            if spend not in (None, "\u2013", "$0.000000"):  # the console shows an en dash for none
                break
            assert time.monotonic() < deadline, f"spend never appeared (shows {spend})"
            driver.execute_script("const b = document.getElementById('key-refresh'); if (b) b.click();")
            time.sleep(0.3)
        assert float(spend.lstrip("$")) > 0

        revoke = wait(driver, by_css('tr[data-id="browser-key"] button[data-action="revoke"]'))
        revoke.click()
        wait(driver, lambda d: "Confirm" in revoke.text)
        revoke.click()
        row_text = "const r = document.querySelector('tr[data-id=\"browser-key\"]'); return r ? r.textContent : '';"
        wait(driver, lambda d: "revoked" in d.execute_script(row_text))  # the table is rebuilt: read it afresh
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=LLAMA, messages=HI, max_tokens=4)

        driver.get(gateway.url + "/ui#audit")  # the console's own changes, by its session, newest first
        wait(driver, page_ready("audit"))
        rows = [r.text for r in driver.find_elements("css selector", "#audit-table tbody tr")]
        assert len(rows) == 2 and all("console:" in r and "browser-key" in r for r in rows), rows
        assert "DELETE /admin/keys/{key_id}" in rows[0] and "POST /admin/keys" in rows[1]
        assert "status: active → revoked" in rows[0] and secret not in " ".join(rows)

        driver.get(gateway.url + "/ui#limits")  # a temporary override, made and ended from the page
        wait(driver, page_ready("limits"))
        wait(driver, by_css("#override-create-rule")).send_keys("tenant-daily")
        wait(driver, by_css("#override-create-value")).send_keys("500")
        wait(driver, by_css("#override-create-for")).send_keys("2h")
        wait(driver, by_css("#override-create-reason")).send_keys("launch")
        wait(driver, by_css("#override-create-submit")).click()
        row = wait(driver, by_css("#overrides-table tbody tr"))
        assert "tenant-daily" in row.text and "usd_per_day" in row.text and "launch" in row.text
        wait(driver, by_css('#overrides-table button[data-action="end-override"]')).click()
        wait(driver, lambda d: not d.find_elements("css selector", "#overrides-table"))

        for name in PAGES:
            driver.get(gateway.url + f"/ui#{name}")
            wait(driver, page_ready(name))
            errors = [e.text for e in driver.find_elements("css selector", "#page .error") if e.text]
            assert not errors, f"page {name}: {errors}"
        # script errors only: the wrong login's 401 and a missing /admin/pools are answers, not faults
        logs = driver.get_log("browser")  # type: ignore[no-untyped-call, unused-ignore]
        severe = [e for e in logs if e["level"] == "SEVERE" and e.get("source") != "network"]
        assert not severe, severe


def test_the_admin_api_refuses_a_cookie_without_its_sessions_csrf_token(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    import json
    import urllib.request

    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    gateway = gateway_factory(
        pools=[static_pool("p", LLAMA, engines.urls)], policies=policies_doc(), server={"admin_token": TOKEN}
    )
    login = urllib.request.Request(gateway.url + "/ui/login", data=json.dumps({"token": TOKEN}).encode(), method="POST")
    with urllib.request.urlopen(login, timeout=10) as response:
        cookie = response.headers["Set-Cookie"].split(";", 1)[0]
        csrf = json.loads(response.read())["csrf_token"]
    assert "HttpOnly" in response.headers["Set-Cookie"] and "SameSite=Strict" in response.headers["Set-Cookie"]

    def call(method: str, path: str, headers: dict[str, str]) -> int:
        request = urllib.request.Request(gateway.url + path, data=b"{}" if method != "GET" else None, method=method)
        for name, value in headers.items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    assert call("GET", "/admin/keys", {"Cookie": cookie}) == 200
    assert call("POST", "/admin/tenants", {"Cookie": cookie}) == 403  # a cross-site form cannot add the header
    assert call("POST", "/admin/tenants", {"Cookie": cookie, "X-Tokenway-CSRF": "1"}) == 403  # nor guess its value
    assert call("POST", "/admin/tenants", {"Cookie": cookie, "X-Tokenway-CSRF": csrf}) == 400  # in, then validated
    assert call("GET", "/admin/keys", {}) == 401


def test_the_pools_page_shows_an_autoscaled_pools_replicas_and_decisions(
    tmp_path: Any, gateway_factory: Callable[..., Gateway]
) -> None:
    """/admin/pools on the pools page: replicas current/desired per role, the planner's decisions and
    the executor's actions, following a cold start from zero replicas."""
    require_browser()
    autoscale = {"min_replicas": 0, "max_replicas": 1, "idle_s": 600, "interval_s": 0.5, "max_hold_s": 120,
                 "scale_down_cooldown_s": 0, "stabilization_s": 0, "startup_s": 5}  # fmt: skip
    pool = {
        "name": "elastic",
        "model": LLAMA,
        "engine": "sim",
        "preset": "llama-3.1-8b@h100",
        "replicas": 0,
        "devices": "auto",
        "ready_timeout_s": 90,
        "extra_args": ["--time-scale", "10"],
        "autoscale": autoscale,
    }
    ports = {name: free_port() for name in ("port_base", "kv_events_port_base", "kv_events_replay_port_base",
                                            "kv_transfer_port_base")}  # fmt: skip
    backends = {"devices": [0], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports}
    gateway = gateway_factory(pools=[pool], backends=backends, server={"admin_token": TOKEN})
    card_text = "const c = document.querySelector('[data-pool=\"elastic\"]'); return c ? c.textContent : '';"
    with chromium() as driver:
        driver.get(gateway.url + "/ui")
        wait(driver, by_css("#token")).send_keys(TOKEN)
        wait(driver, by_css("#login-submit")).click()
        wait(driver, by_css("#nav"))
        driver.get(gateway.url + "/ui#pools")
        wait(driver, page_ready("pools"))
        wait(driver, lambda d: "replicas current/desired 0/0" in d.execute_script(card_text), 60)
        wait(driver, lambda d: "Recent decisions" in d.execute_script(card_text), 60)  # the first plan

        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=180)
        reply = client.chat.completions.create(model=LLAMA, messages=COLOUR, max_tokens=8)  # held: cold start
        assert reply.choices[0].message.content

        wait(driver, lambda d: "replicas current/desired 1/1" in d.execute_script(card_text), 60)  # 5 s refresh
        text = driver.execute_script(card_text)
        assert "0 \u2192 1" in text  # the scale-up decision, current -> desired
        assert "Recent actions" in text and "start both" in text and "ready both" in text
        errors = [e.text for e in driver.find_elements("css selector", "#page .error") if e.text]
        assert not errors, errors
        logs = driver.get_log("browser")  # type: ignore[no-untyped-call, unused-ignore]
        severe = [e for e in logs if e["level"] == "SEVERE" and e.get("source") != "network"]
        assert not severe, severe

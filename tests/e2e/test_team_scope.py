"""A team admin reads only its teams (issue 45), on a real gateway process with traffic, limits,
overrides and audit records of two teams: every admin read of /openapi.json, walked as the team admin
of one team, never shows the other team's tenant or key, and a read the roles table does not declare
for team admins is refused; the team-scoped reads (usage, live tail, audit, limits, overrides) show
the team's own rows; a viewer still reads everything; `GET /admin/usage?format=csv` is a download
whose text cells cannot run as spreadsheet formulas."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from policies.policy import hash_key
from tests.support.procs import Gateway, SimEngines, policies_doc, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LLAMA = "llama-3.1-8b"
ADMIN_TOKEN = "team-scope-admin-token-0123456789"
TOKENS = {"vera": "twu-vera-viewer-token", "tom": "twu-tom-search-admin-token"}
SECRETS = {"search-1": "tw-search-one-secret-000", "ads-1": "tw-ads-one-secret-0000"}
OTHER_TEAM = ("ads-bid", "ads-1", "ads-2")  # nothing of team ads may reach tom
FORMULA_USER = '=HYPERLINK("http://x")'
POLICY = policies_doc(
    teams={"search": {}, "ads": {}},
    tenants={"search-web": {"team": "search"}, "ads-bid": {"team": "ads"}},
    keys=[
        {"id": "search-1", "tenant": "search-web", "sha256": hash_key(SECRETS["search-1"])},
        {"id": "ads-1", "tenant": "ads-bid", "sha256": hash_key(SECRETS["ads-1"])},
    ],
    models={LLAMA: {"price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}},
    limits=[
        {"id": "tenant-rpm", "scope": "tenant", "rpm": 1000},
        {"id": "key-rpm", "scope": "key", "rpm": 1000},
        {"id": "all-rpm", "scope": "global", "rpm": 100000},
    ],
    budgets=[{"id": "tenant-daily", "scope": "tenant", "usd_per_day": 100.0}],
)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


USERS = [
    {"name": "vera", "role": "viewer", "tokens_sha256": [digest(TOKENS["vera"])]},
    {"name": "tom", "role": "team_admin", "teams": ["search"], "tokens_sha256": [digest(TOKENS["tom"])]},
]


def raw_call(gateway: Gateway, token: str, method: str, path: str, body: Any = None) -> tuple[int, bytes, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(gateway.url + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def call(gateway: Gateway, token: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    status, raw, _ = raw_call(gateway, token, method, path, body)
    return status, json.loads(raw)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.support.procs import start_gateway, start_sim

    tmp = tmp_path_factory.mktemp("team-scope")
    engines: SimEngines = start_sim(tmp, count=1, time_scale=50, served_model_name=LLAMA)
    try:
        gateway = start_gateway(
            tmp / "gw",
            pools=[static_pool("p", LLAMA, engines.urls)],
            policies=POLICY,
            server={"admin_token": ADMIN_TOKEN, "users": USERS},
        )
    except Exception:
        engines.stop()
        raise
    try:
        seed(gateway)
        yield gateway
    finally:
        gateway.stop()
        engines.stop()


def seed(gateway: Gateway) -> None:
    """Traffic, API keys, overrides (one per team, one for every subject) and their audit records."""
    for tenant, key in (("search-web", "search-2"), ("ads-bid", "ads-2")):
        assert call(gateway, ADMIN_TOKEN, "POST", "/admin/keys", {"tenant": tenant, "id": key})[0] == 201
    for subject in ("search-web", "ads-bid", None):
        body: dict[str, Any] = {"rule": "tenant-daily" if subject else "all-rpm", "for": "2h", "reason": "launch"}
        body |= {"subject": subject, "dimension": "usd_per_day", "value": 200} if subject else {"dimension": "rpm",
                                                                                                "value": 5}  # fmt: skip
        assert call(gateway, ADMIN_TOKEN, "POST", "/admin/overrides", body)[0] == 201
    for key, secret in SECRETS.items():
        client = openai.OpenAI(base_url=gateway.base_url, api_key=secret, max_retries=0)
        reply = client.chat.completions.create(
            model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=4, user=FORMULA_USER
        )
        assert reply.choices[0].message.content is not None, key
    deadline = time.monotonic() + 30
    while True:  # the ledger's group commit: both records on disk
        status, found = call(gateway, ADMIN_TOKEN, "GET", "/admin/usage?since=1h&by=tenant")
        if status == 200 and found["total"]["requests"] >= 2:
            return
        assert time.monotonic() < deadline, found
        time.sleep(0.2)


def leaks(raw: bytes) -> list[str]:
    text = raw.decode("utf-8", "replace")
    return [name for name in OTHER_TEAM if name in text]


def test_every_admin_read_of_the_document_keeps_a_team_admin_to_its_teams(gateway: Gateway) -> None:
    """The structural walk: each admin GET of /openapi.json, as tom (team search), answers with no
    name of team ads; a read whose `x-tokenway-team-scope` is `none` (or undeclared) is refused."""
    from gateway.http.openapi import operations

    own = {"key_id": "search-1", "name": "search-web", "pool": "p", "override_id": "none", "model": LLAMA}
    reads = [(p, op) for m, p, op in operations() if m == "GET" and op["x-tokenway-auth"] == "admin"]
    assert len(reads) >= 14
    shown_to_viewer = set()  # team reads whose viewer's answer does name team ads: the walk is not vacuous
    for template, op in reads:
        scope = op["x-tokenway-team-scope"]
        assert scope in ("fleet", "team", "none"), template
        status, raw, _ = raw_call(gateway, TOKENS["tom"], "GET", template.format(**own))
        if scope == "none":
            assert status == 403 and b"role_forbidden" in raw, (template, status)
            continue
        assert status < 500 and status != 403, (template, status, raw[:300])
        assert not leaks(raw), (template, leaks(raw))
        viewer_status, viewer_raw, _ = raw_call(gateway, TOKENS["vera"], "GET", template.format(**own))
        assert viewer_status == status, template
        if scope == "fleet":  # fleet data is the same to both, and names no tenant
            assert not leaks(viewer_raw), (template, "a fleet read names a tenant: declare it team or none")
        elif leaks(viewer_raw):
            shown_to_viewer.add(template)
    assert shown_to_viewer >= {
        "/admin/keys", "/admin/tenants", "/admin/activity", "/admin/usage", "/admin/audit", "/admin/overrides",
        "/admin/status",
    }  # fmt: skip


def test_the_team_scoped_reads_show_the_teams_own_rows(gateway: Gateway) -> None:
    tom, vera = TOKENS["tom"], TOKENS["vera"]

    status, usage = call(gateway, tom, "GET", "/admin/usage?since=1h&by=tenant")
    assert status == 200 and [r["tenant"] for r in usage["rows"]] == ["search-web"]
    assert usage["total"]["requests"] == 1 and usage["team_scope"] == {"teams": ["search"]}
    viewer_usage = call(gateway, vera, "GET", "/admin/usage?since=1h&by=tenant")[1]
    assert {r["tenant"] for r in viewer_usage["rows"]} == {"search-web", "ads-bid"}  # unchanged for viewers

    activity = call(gateway, tom, "GET", "/admin/activity")[1]
    assert [r["key_id"] for r in activity["tail"]] == ["search-1"]
    assert activity["summary"]["requests"] == 1  # its teams' own minute counters, not the fleet's
    assert sum(m["requests"] for m in activity["minutes"]) == 1 and activity["models"] == [LLAMA]
    assert all(set(m) >= {"t", "cost_usd"} and "teams" not in m and "team_models" not in m for m in activity["minutes"])
    assert sum(m["models"].get(LLAMA, {}).get("requests", 0) for m in activity["minutes"]) == 1  # its teams' own
    assert activity["team_scope"] == {"teams": ["search"]}
    fleet = call(gateway, vera, "GET", "/admin/activity")[1]
    assert fleet["summary"]["requests"] == 2
    by_team = [m["teams"] for m in fleet["minutes"] if m["teams"]]
    assert sum(t.get("search", {}).get("requests", 0) + t.get("ads", {}).get("requests", 0) for t in by_team) == 2

    status_doc = call(gateway, tom, "GET", "/admin/status")[1]
    subjects = {(r["rule"], r["subject"]) for r in status_doc["limits"]}
    assert ("tenant-rpm", "search-web") in subjects and ("key-rpm", "search-1") in subjects
    assert all(r["scope"] in ("tenant", "key") for r in status_doc["limits"])  # never the global bucket
    assert status_doc["flow"] is None and "decisions" not in status_doc["admission"]
    assert any(r["subject"] == "*" for r in call(gateway, vera, "GET", "/admin/status")[1]["limits"])

    overrides = call(gateway, tom, "GET", "/admin/overrides")[1]["data"]
    assert [(o["rule"], o["subject"]) for o in overrides] == [("tenant-daily", "search-web")]
    assert len(call(gateway, vera, "GET", "/admin/overrides")[1]["data"]) == 3

    audit = call(gateway, tom, "GET", "/admin/audit")[1]["data"]
    assert {r["target"] for r in audit if r["route"] == "/admin/keys"} == {"search-2"}
    assert sum(r["route"] == "/admin/overrides" for r in audit) == 1
    status, _ = call(gateway, tom, "PATCH", "/admin/keys/search-2", {"limits": {"rpm": 9}})
    assert status == 200
    mine = call(gateway, tom, "GET", "/admin/audit?actor=user:tom")[1]["data"]
    assert [r["target"] for r in mine] == ["search-2"]  # its own change, and it only
    assert len(call(gateway, vera, "GET", "/admin/audit?limit=1000")[1]["data"]) == 6  # 2 keys, 3 overrides, 1 patch


def test_usage_as_csv_is_a_bounded_download_safe_for_spreadsheets(gateway: Gateway) -> None:
    status, raw, headers = raw_call(gateway, ADMIN_TOKEN, "GET", "/admin/usage?since=1h&by=tenant,user&format=csv")
    assert status == 200
    assert headers["Content-Type"].startswith("text/csv") and "charset=utf-8" in headers["Content-Type"]
    assert headers["Content-Disposition"].startswith('attachment; filename="tokenway-usage-')
    assert headers["X-Tokenway-Usage-Groups"] == "2" and headers["X-Tokenway-Usage-Rows"] == "2"
    rows = list(csv.reader(io.StringIO(raw.decode())))
    assert rows[0][:4] == ["tenant", "user", "requests", "served"]
    assert {r[0] for r in rows[1:-1]} == {"search-web", "ads-bid"} and rows[-1][0] == "TOTAL"
    assert {r[1] for r in rows[1:-1]} == {"'" + FORMULA_USER}  # quoted: a spreadsheet shows it as text
    assert rows[-1][2] == "2"

    status, raw, _ = raw_call(gateway, TOKENS["tom"], "GET", "/admin/usage?since=1h&by=key&format=csv")
    assert status == 200 and not leaks(raw)
    assert [r[0] for r in csv.reader(io.StringIO(raw.decode()))][1:] == ["search-1", "TOTAL"]

    for query in ("format=xml", "by=nope&format=csv", "since=never&format=csv"):
        status, body = call(gateway, ADMIN_TOKEN, "GET", f"/admin/usage?{query}")
        assert status == 400 and body["error"]["type"] == "invalid_request_error", query


def test_the_console_shows_a_team_admin_its_teams_data_only(gateway: Gateway) -> None:
    """Debian's headless Chromium, logged in with the team admin's token: the overview says its
    own teams' counters (not the fleet's), and usage (its CSV download too), limits and overrides, live
    tail and audit show team search's rows and never team ads'."""
    from tests.e2e.test_console import by_css, page_ready, wait
    from tests.e2e.test_console_lists import downloaded
    from tests.support.browser import chromium, require_browser

    require_browser()
    folder = Path(tempfile.mkdtemp(prefix="tokenway-team-csv-"))
    page_text = "return document.getElementById('page').innerText;"
    with chromium() as driver:
        driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(folder)})
        driver.get(gateway.url + "/ui")
        wait(driver, by_css("#token")).send_keys(TOKENS["tom"])
        wait(driver, by_css("#login-submit")).click()
        wait(driver, page_ready("overview"))
        assert "team admin of search" in wait(driver, by_css("#whoami")).text
        wait(driver, by_css("#stat-rps"))  # its teams' own counters, per model too
        assert "your teams (search): 1 requests" in wait(driver, by_css("#overview-window")).text
        assert driver.find_element("css selector", "#chart-model-latency").is_displayed()
        assert not [e.text for e in driver.find_elements("css selector", "#page .error") if e.text]

        driver.get(gateway.url + "/ui#usage")
        wait(driver, page_ready("usage"))
        usage_rows = wait(driver, by_css("#usage-table")).text
        assert "search-web" in usage_rows and not leaks(usage_rows.encode())
        wait(driver, by_css("#usage-csv")).click()
        exported = downloaded(folder, "tokenway-usage-")
        assert [r["tenant"] for r in exported] == ["search-web", "TOTAL"] and exported[-1]["requests"] == "1"

        for name, table in (("limits", "#overrides-table"), ("tail", "#tail-table"), ("audit", "#audit-table")):
            driver.get(gateway.url + f"/ui#{name}")
            wait(driver, page_ready(name))
            shown = wait(driver, by_css(table)).text
            assert "search" in shown, (name, shown)
            wait(driver, by_css(".team-note"))
            text = driver.execute_script(page_text)
            assert not leaks(text.encode()), (name, leaks(text.encode()))
            assert not [e.text for e in driver.find_elements("css selector", "#page .error") if e.text], name
        logs = driver.get_log("browser")  # type: ignore[no-untyped-call, unused-ignore]
        severe = [e for e in logs if e["level"] == "SEVERE" and e.get("source") != "network"]
        assert not severe, severe

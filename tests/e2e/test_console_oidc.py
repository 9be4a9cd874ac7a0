"""Single sign-on end to end (issue 45): a real gateway process, an OpenID Connect provider started by
the test (tests/support/oidc_provider.py: its own RSA key, a real HTTP server on a free port) and
Debian's headless Chromium. The browser clicks "Log in with single sign-on", signs in at the provider,
comes back logged in as a team admin (its groups claim mapped by `server.oidc.group_roles`), sees its
team's keys only, and the gateway refuses it another team's key (403 role_forbidden) when the page
asks; an email named in `server.users` logs in as that user."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.test_console import by_css, page_ready, wait
from tests.support.browser import chromium, require_browser
from tests.support.oidc_provider import Provider, oidc_provider
from tests.support.procs import Gateway, SimEngines, policies_doc, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LLAMA = "llama-3.1-8b"
ADMIN_TOKEN = "oidc-test-admin-token-0123456789"
CLIENT_ID, CLIENT_SECRET = "tokenway-console", "oidc-test-client-secret"
PEOPLE = {
    "alice": {"email": "alice@example.com", "email_verified": True, "groups": ["search-leads"]},
    "bob": {"email": "bob@example.com", "email_verified": True, "groups": []},
    "eve": {"email": "eve@example.com", "email_verified": True, "groups": ["nobody-we-know"]},
}
POLICY = policies_doc(
    teams={"search": {}, "ads": {}},
    tenants={"search-web": {"team": "search"}, "ads-bid": {"team": "ads"}},
    keys=[],
)


def admin(gateway: Gateway, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(gateway.url + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def provider() -> Iterator[Provider]:
    with oidc_provider(CLIENT_ID, CLIENT_SECRET, PEOPLE) as found:
        yield found


@pytest.fixture
def gateway(
    provider: Provider, sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> Gateway:
    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    oidc = {
        "issuer": provider.issuer,
        "client_id": CLIENT_ID,
        "client_secret": CLIENT_SECRET,
        "group_roles": {"search-leads": {"role": "team_admin", "teams": ["search"]}},
    }
    bob = {
        "name": "bob",
        "role": "admin",
        "emails": ["bob@example.com"],
        "tokens_sha256": [hashlib.sha256(b"b").hexdigest()],
    }
    gateway = gateway_factory(
        pools=[static_pool("p", LLAMA, engines.urls)],
        policies=POLICY,
        server={"admin_token": ADMIN_TOKEN, "users": [bob], "oidc": oidc},
    )
    provider.redirect_uris.append(gateway.url + "/ui/oidc/callback")
    for tenant, key in (("search-web", "search-1"), ("ads-bid", "ads-1")):
        assert admin(gateway, "POST", "/admin/keys", {"tenant": tenant, "id": key})[0] == 201
    return gateway


def sign_in(driver: Any, gateway: Gateway, who: str) -> None:
    driver.get(gateway.url + "/ui")
    wait(driver, by_css("#oidc-login")).click()
    wait(driver, by_css("#username")).send_keys(who)  # the provider's own page
    wait(driver, by_css("#approve")).click()


def refused(driver: Any) -> bool:
    body = str(driver.find_element("tag name", "body").text)
    return "role_forbidden" in body or "has no role on this gateway" in body


# A call the console page itself makes (same origin, its cookie, its session's CSRF token)
PAGE_PATCH = """
const done = arguments[arguments.length - 1];
(async () => {
  const session = await (await fetch("/ui/session", { credentials: "same-origin" })).json();
  const answer = await fetch(arguments[0], {
    method: "PATCH", credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-Tokenway-CSRF": session.csrf_token },
    body: JSON.stringify({ limits: { rpm: 5 } }),
  });
  done({ status: answer.status, body: await answer.json() });
})().catch((e) => done({ status: 0, body: String(e) }));
"""


def test_a_team_admin_signs_in_through_the_provider_and_is_refused_another_teams_key(gateway: Gateway) -> None:
    require_browser()
    with chromium() as driver:
        sign_in(driver, gateway, "alice")
        who = wait(driver, by_css("#whoami"))
        assert "oidc:alice@example.com" in who.text and "team admin of search" in who.text
        cookie = driver.get_cookie("tokenway_console")
        assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert "code=" not in driver.current_url and driver.current_url.startswith(gateway.url + "/ui")

        driver.get(gateway.url + "/ui#keys")
        wait(driver, page_ready("keys"))
        wait(driver, by_css('tr[data-id="search-1"]'))
        assert not driver.find_elements("css selector", 'tr[data-id="ads-1"]')  # another team's: not shown
        tenants = [o.text for o in driver.find_elements("css selector", "#create-key-tenant option")]
        assert tenants == ["search-web"]

        driver.set_script_timeout(20)
        refused = driver.execute_async_script(PAGE_PATCH, "/admin/keys/ads-1")
        assert refused["status"] == 403 and refused["body"]["error"]["code"] == "role_forbidden"
        allowed = driver.execute_async_script(PAGE_PATCH, "/admin/keys/search-1")
        assert allowed["status"] == 200 and allowed["body"]["limits"]["rpm"] == 5

    status, ads = admin(gateway, "GET", "/admin/keys/ads-1")
    assert status == 200 and not ads["limits"]  # untouched
    audit = admin(gateway, "GET", "/admin/audit?target=search-1")[1]
    assert audit["data"][0]["actor"] == "oidc:alice@example.com"


def test_an_email_of_server_users_signs_in_as_that_user_and_an_unknown_one_is_refused(gateway: Gateway) -> None:
    require_browser()
    with chromium() as driver:
        sign_in(driver, gateway, "bob")
        who = wait(driver, by_css("#whoami"))
        assert "user:bob" in who.text and "admin" in who.text
        driver.get(gateway.url + "/ui#tenants")
        wait(driver, page_ready("tenants"))
        wait(driver, by_css("#create-tenant-submit"))  # an admin may create tenants

    with chromium() as driver:
        sign_in(driver, gateway, "eve")
        # the refusal is the callback's page: read it once the browser has landed there (a body read
        # while the provider's redirect is under way is a stale element)
        wait(driver, refused)
        assert driver.get_cookie("tokenway_console") is None

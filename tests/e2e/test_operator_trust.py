"""The operator surfaces (/admin/*, the console /ui/*) against hostile callers, on real gateways:
a DNS-rebound page, a same-host reverse proxy, another loopback origin in a real Chromium, a login
guesser, a careless operator's weak token, poisoned admin input, and a Redis that restarts empty."""

from __future__ import annotations

import http.client
import http.server
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
import yaml

from policies.keys.records import KeyRecord
from policies.keys.store import SqliteDirectoryStore
from tests.support.browser import chromium, require_browser
from tests.support.polling import wait_for
from tests.support.procs import Gateway, _env, free_port, policies_doc, redis_argv, start_gateway, stop_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TOKEN = "operator-trust-admin-token-4f1c9a"
REBOUND = "rebind.attacker.example"


def call(
    gateway: Gateway,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: Any = None,
    host: str | None = None,
) -> tuple[int, dict[str, str], Any]:
    """One request with exactly the headers given (`host` replaces the Host header)."""
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        connection.putheader("Host", host if host is not None else f"127.0.0.1:{gateway.port}")
        data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        if data is not None:
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(len(data)))
        connection.endheaders(data)
        response = connection.getresponse()
        raw = response.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw
        return response.status, {k.lower(): v for k, v in response.getheaders()}, parsed
    finally:
        connection.close()


def key_ids(gateway: Gateway) -> set[str]:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, _, body = call(gateway, "GET", "/admin/keys?include_revoked=1", auth)
    if status == 403:  # a gateway without a token: the loopback caller itself
        status, _, body = call(gateway, "GET", "/admin/keys?include_revoked=1")
    assert status == 200, body
    return {row["id"] for row in body["data"]}


def cookie_of(headers: dict[str, str]) -> str:
    return headers["set-cookie"].split(";", 1)[0]


# ---------------------------------------------------------------------- class 1: DNS rebinding, proxies
def test_loopback_trust_needs_a_host_naming_the_gateway_and_no_proxy(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gateway = gateway_factory(pools=[])  # `make run`'s default: loopback, no admin token
    rebound = f"{REBOUND}:{gateway.port}"
    for method, path, body in [
        ("GET", "/admin/keys", None),
        ("POST", "/admin/keys", {"tenant": "t1", "id": "rebound"}),
        ("GET", "/admin/status", None),
        ("GET", "/ui", None),
        ("GET", "/ui/session", None),
        ("POST", "/ui/login", {"token": ""}),
    ]:
        status, headers, answer = call(gateway, method, path, body=body, host=rebound)
        assert status == 403, (method, path, status, answer)
        assert answer["error"]["code"] == "host_not_allowed" and "set-cookie" not in headers
    status, _, answer = call(gateway, "GET", "/admin/keys", {"Origin": f"http://{REBOUND}"})
    assert status == 403 and answer["error"]["code"] == "host_not_allowed"
    assert call(gateway, "GET", "/admin/keys", host="127.0.0.1:1")[0] == 403  # another local port
    assert "rebound" not in key_ids(gateway)
    for host in (f"127.0.0.1:{gateway.port}", f"localhost:{gateway.port}"):  # what the gateway answers to
        assert call(gateway, "GET", "/admin/keys", host=host)[0] == 200
        assert call(gateway, "GET", "/ui", host=host)[0] == 200

    # through a reverse proxy on the same host: no loopback trust, no cookie, and a cookie does not help
    proxy = {"X-Forwarded-For": "203.0.113.9"}
    status, headers, _ = call(gateway, "POST", "/ui/login", proxy, body={"token": ""})
    assert status == 403 and "set-cookie" not in headers
    assert call(gateway, "POST", "/ui/login", {"X-Real-IP": "203.0.113.9"}, body={})[0] == 403
    status, headers, login = call(gateway, "POST", "/ui/login", body={"token": ""})  # direct: the local operator
    assert status == 200 and login["csrf_token"]
    cookie = cookie_of(headers)
    assert "HttpOnly" in headers["set-cookie"] and "SameSite=Strict" in headers["set-cookie"]
    assert "Path=/" in headers["set-cookie"]
    assert call(gateway, "GET", "/admin/keys", {**proxy, "Cookie": cookie})[0] == 403
    made = {"Cookie": cookie, "X-Tokenway-CSRF": login["csrf_token"], **proxy}
    assert call(gateway, "POST", "/admin/keys", made, body={"tenant": "t1", "id": "via-proxy"})[0] == 403
    session = call(gateway, "GET", "/ui/session", {**proxy, "Cookie": cookie})
    assert session[0] == 200 and not session[2]["authenticated"] and "csrf_token" not in session[2]
    rebound_with_cookie = {"Cookie": cookie, "X-Tokenway-CSRF": login["csrf_token"]}
    assert call(gateway, "GET", "/admin/keys", rebound_with_cookie, host=rebound)[0] == 403
    assert "via-proxy" not in key_ids(gateway)


def test_allowed_hosts_are_checked_with_an_admin_token_too(gateway_factory: Callable[..., Gateway]) -> None:
    gateway = gateway_factory(pools=[], server={"admin_token": TOKEN, "allowed_hosts": ["gw.example.test"]})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert call(gateway, "GET", "/admin/keys", auth, host="gw.example.test")[0] == 200
    assert call(gateway, "GET", "/admin/keys", auth, host=f"gw.example.test:{gateway.port}")[0] == 200
    assert call(gateway, "GET", "/admin/keys", auth)[0] == 200  # loopback literal on its port
    status, _, answer = call(gateway, "GET", "/admin/keys", auth, host=REBOUND)
    assert status == 403 and answer["error"]["code"] == "host_not_allowed"
    status, headers, _ = call(gateway, "POST", "/ui/login", body={"token": TOKEN}, host=REBOUND)
    assert status == 403 and "set-cookie" not in headers
    # a proxied request may use the token (the token is the credential) but never an empty login
    proxied = {"X-Forwarded-For": "203.0.113.9"}
    assert call(gateway, "GET", "/admin/keys", {**auth, **proxied})[0] == 200
    status, headers, _ = call(gateway, "POST", "/ui/login", proxied, body={"token": ""})
    assert status == 401 and "set-cookie" not in headers


# ---------------------------------------------------------------------- class 2: CSRF
def test_a_console_cookie_changes_nothing_without_its_sessions_csrf_token(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gateway = gateway_factory(pools=[], server={"admin_token": TOKEN})
    status, headers, login = call(gateway, "POST", "/ui/login", body={"token": TOKEN})
    assert status == 200
    cookie, csrf = cookie_of(headers), login["csrf_token"]
    other = call(gateway, "POST", "/ui/login", body={"token": TOKEN})[2]["csrf_token"]
    assert csrf != other  # one per session
    assert call(gateway, "GET", "/ui/session", {"Cookie": cookie})[2]["csrf_token"] == csrf
    assert call(gateway, "GET", "/admin/keys", {"Cookie": cookie})[0] == 200
    body = {"tenant": "t1", "id": "csrf-probe"}
    for extra in ({}, {"X-Tokenway-CSRF": "1"}, {"X-Tokenway-Console": "1"}, {"X-Tokenway-CSRF": other}):
        status, _, answer = call(gateway, "POST", "/admin/keys", {"Cookie": cookie, **extra}, body=body)
        assert status == 403 and answer["error"]["code"] == "csrf_token_invalid", (extra, answer)
    cross = {"Cookie": cookie, "X-Tokenway-CSRF": csrf, "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    assert call(gateway, "POST", "/admin/keys", cross, body=body)[0] == 403
    with_token = {"Origin": "http://evil.example", "Authorization": f"Bearer {TOKEN}"}
    assert call(gateway, "POST", "/admin/keys", with_token, body=body)[0] == 403  # whatever the credentials
    assert "csrf-probe" not in key_ids(gateway)
    assert call(gateway, "POST", "/admin/keys", {"Cookie": cookie, "X-Tokenway-CSRF": csrf}, body=body)[0] == 201
    call(gateway, "POST", "/ui/logout", {"Cookie": cookie})
    status, _, _ = call(gateway, "DELETE", "/admin/keys/csrf-probe", {"Cookie": cookie, "X-Tokenway-CSRF": csrf})
    assert status == 401  # the session ended with its token


ATTACK = """<!doctype html><html><body><iframe name="sink"></iframe>
<form id="f" method="POST" target="sink" enctype="text/plain" action="GATEWAY/admin/keys">
<input name='{"tenant":"t1","id":"evil-form","x":"' value='"}'></form>
<script>
(async () => {
  const results = [];
  const attempts = [
    () => fetch("GATEWAY/admin/keys", {method: "POST", credentials: "include", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body: JSON.stringify({tenant: "t1", id: "evil-simple"})}),
    () => fetch("GATEWAY/admin/keys", {method: "POST", credentials: "include",
      headers: {"Content-Type": "application/json", "X-Tokenway-CSRF": "guess"},
      body: JSON.stringify({tenant: "t1", id: "evil-cors"})}),
    () => fetch("GATEWAY/ui/session", {credentials: "include"}).then((r) => r.json()),
  ];
  for (const attempt of attempts) {
    try { const r = await attempt(); results.push(r && r.csrf_token ? "LEAKED " + r.csrf_token : "sent"); }
    catch (e) { results.push("failed: " + e); }
  }
  document.getElementById("f").submit();
  document.title = "done " + JSON.stringify(results);
})();
</script></body></html>"""


@contextmanager
def attacker_site(gateway: Gateway) -> Iterator[str]:
    """A page on another loopback origin (same host, another port: the browser sends the gateway's
    SameSite=Strict cookie with its requests, as it would for any same-site page)."""
    page = ATTACK.replace("GATEWAY", gateway.url).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("admin_token", [TOKEN, None], ids=["token", "loopback"])
def test_a_page_of_another_origin_cannot_use_a_logged_in_console(
    gateway_factory: Callable[..., Gateway], admin_token: str | None
) -> None:
    require_browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = {"admin_token": admin_token} if admin_token else {}
    gateway = gateway_factory(pools=[], server=server)
    with chromium() as driver, attacker_site(gateway) as attacker:
        wait = WebDriverWait(driver, 30, poll_frequency=0.1)
        driver.get(gateway.url + "/ui")
        token = wait.until(lambda d: d.find_element(By.ID, "token"))
        wait.until(lambda d: token.is_displayed())
        token.send_keys(admin_token or "")
        driver.find_element(By.ID, "login-submit").click()
        wait.until(lambda d: d.find_element(By.ID, "nav").is_displayed())
        # the login answer set the session cookie; the browser's cookie store, which the driver reads, may
        # commit it a moment after the page ran on: wait for it rather than read it once (a loaded CI host)
        wait.until(lambda d: d.get_cookie("tokenway_console") is not None)

        driver.get(attacker)
        wait.until(lambda d: d.title.startswith("done"))
        assert "LEAKED" not in driver.title, driver.title
        time.sleep(1.0)  # the form's POST lands in the frame (its answer cannot be read cross-origin)
        assert not {i for i in key_ids(gateway) if i.startswith("evil")}

        # control: the same session, from the console's own origin, can make a key
        driver.get(gateway.url + "/ui")
        wait.until(lambda d: d.find_element(By.ID, "nav").is_displayed())
        status = driver.execute_async_script(
            """const done = arguments[arguments.length - 1];
            fetch("/ui/session").then((r) => r.json()).then((s) => fetch("/admin/keys", {method: "POST",
              headers: {"Content-Type": "application/json", "X-Tokenway-CSRF": s.csrf_token},
              body: JSON.stringify({tenant: "t1", id: "console-made"})})).then((r) => done(r.status));"""
        )
        assert status == 201
        assert "console-made" in key_ids(gateway)


# ---------------------------------------------------------------------- class 3: login guessing, weak tokens
def test_login_guessing_is_slowed_audited_and_the_token_never_logged(gateway_factory: Callable[..., Gateway]) -> None:
    gateway = gateway_factory(pools=[], server={"admin_token": TOKEN})
    statuses = []
    for i in range(12):
        status, headers, answer = call(gateway, "POST", "/ui/login", body={"token": f"guess-{i:04d}"})
        statuses.append(status)
        assert "set-cookie" not in headers
        if status == 429:
            assert int(headers["retry-after"]) >= 1 and answer["error"]["code"] == "login_throttled"
    assert statuses[:5] == [401] * 5 and statuses[-1] == 429
    failures = statuses.count(401)
    status, headers, _ = call(gateway, "POST", "/ui/login", body={"token": TOKEN})
    assert status == 429 and "set-cookie" not in headers  # the backoff holds even for the right token
    bad: object
    for bad in ([], {"token": None}, {"token": 12}, b"not json"):  # no body or a wrong type is a failure too
        assert call(gateway, "POST", "/ui/login", body=bad)[0] in (401, 429)
    log = gateway.log()
    audit = [line for line in log.splitlines() if "console login failed" in line]
    assert len(audit) == failures and all("127.0.0.1" in line for line in audit)
    assert "guess-0" not in log and TOKEN not in log


@pytest.mark.parametrize("token", ["change-me", "admin", "short-token", None])
def test_a_gateway_beyond_loopback_refuses_to_start_with_a_weak_token(tmp_path: Path, token: str | None) -> None:
    server: dict[str, Any] = {"host": "0.0.0.0", "port": free_port()}
    if token is not None:
        server["admin_token"] = token
    (tmp_path / "policies.yaml").write_text(yaml.safe_dump(policies_doc()))
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({"server": server, "policies": "policies.yaml"}))
    done = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "serve", "--config", str(tmp_path / "gateway.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_env(),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "server.admin_token" in done.stderr
    if token is not None:
        assert "weak" in done.stderr and repr(token) not in done.stderr


# ---------------------------------------------------------------------- class 7: poisoned admin records
POISON: list[tuple[dict[str, Any], str]] = [
    ({"tenant": "t1", "id": "p1", "expires_in": "99999999999999d"}, "expires_in"),
    ({"tenant": "t1", "id": "p2", "expires_at": 1e300}, "expires_at"),
    ({"tenant": "t1", "id": "p3", "expires_at": -1}, "expires_at"),
    ({"tenant": "t1", "id": "p4", "expires_at": True}, "expires_at"),
    ({"tenant": "t1", "id": "p5", "expires_at": "x" * 100_000}, "expires_at"),
    ({"tenant": "t1", "id": "p6", "limits": {"rpm": 10**30}}, "limits.rpm"),
    ({"tenant": "t1", "id": "p7", "limits": {"tpm": -5}}, "limits.tpm"),
    ({"tenant": "t1", "id": "p8", "limits": {"usd_per_day": 1e300}}, "limits.usd_per_day"),
    ({"tenant": "t1", "id": "p9", "limits": {"rpm": "many"}}, "limits.rpm"),
    ({"tenant": "t1" * 50_000, "id": "p10"}, "tenant"),
    ({"tenant": ["t1"], "id": "p11"}, "tenant"),
    ({"tenant": "t1", "id": "p12", "models": ["m"] * 10_000}, "models"),
    ({"tenant": "t1", "id": "p13", "metadata": {"owner": "o" * 1_000_000}}, "metadata.owner"),
    ({"tenant": "t1", "id": "p14", "priority": {"$ne": 1}}, "priority"),
]


def test_poisoned_admin_input_is_refused_naming_the_field_and_nothing_is_stored(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gateway = gateway_factory(pools=[], server={"admin_token": TOKEN})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for body, field in POISON:
        status, _, answer = call(gateway, "POST", "/admin/keys", auth, body=body)
        assert status == 400, (field, status, str(answer)[:300])
        assert answer["error"]["param"] == field and answer["error"]["type"] == "invalid_request_error"
    for raw in (b'{"tenant": "t1", "expires_at": NaN}', b'{"tenant": "t1", "expires_at": Infinity}', b"[1]"):
        assert call(gateway, "POST", "/admin/keys", auth, body=raw)[0] == 400
    assert call(gateway, "POST", "/admin/keys", auth, body={"tenant": "t1", "id": "ok"})[0] == 201
    patches: list[tuple[dict[str, Any], str]] = [
        ({"expires_in": "99999999999999d"}, "expires_in"),
        ({"expires_at": 1e300}, "expires_at"),
        ({"limits": {"rpm": 10**30}}, "limits.rpm"),
        ({"limits": {"nope": 1}}, "limits"),
    ]
    for body, field in patches:
        status, _, answer = call(gateway, "PATCH", "/admin/keys/ok", auth, body=body)
        assert status == 400 and answer["error"]["param"] == field, answer
    assert call(gateway, "POST", "/admin/keys/ok/rotate", auth, body={"grace_s": 1e300})[0] == 400
    tenant = {"name": "t9", "limits": {"tpm": 10**40}}
    assert call(gateway, "POST", "/admin/tenants", auth, body=tenant)[2]["error"]["param"] == "limits.tpm"
    assert call(gateway, "PATCH", "/admin/tenants/t9", auth, body={})[0] == 404  # never made
    assert key_ids(gateway) >= {"ok"} and not {f"p{i}" for i in range(1, 15)} & key_ids(gateway)
    assert call(gateway, "GET", "/admin/keys/ok", auth)[2]["expires_at"] is None


def test_a_stored_record_that_cannot_be_rendered_never_takes_the_listing_down(
    tmp_path: Path, gateway_factory: Callable[..., Gateway]
) -> None:
    import asyncio

    async def plant() -> None:  # as an older version, before inputs were bounded, could store it
        store = SqliteDirectoryStore(tmp_path / "gw0" / "var" / "keys.sqlite3")
        for key_id, expires in (("poisoned", 1e300), ("fine", None)):
            record = KeyRecord(
                id=key_id, tenant="t1", sha256=f"{len(key_id):064x}", expires_at_unix_s=expires,
                created_at_unix_s=time.time(), updated_at_unix_s=time.time(),
            )  # fmt: skip
            await store.write("key", key_id, record.model_dump_json())
        await store.close()

    asyncio.run(plant())
    gateway = gateway_factory(pools=[], server={"admin_token": TOKEN})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, _, listing = call(gateway, "GET", "/admin/keys", auth)
    assert status == 200, listing
    rows = {row["id"]: row for row in listing["data"]}
    assert rows["poisoned"]["status"] == "unreadable" and rows["fine"]["status"] == "active"
    status, _, shown = call(gateway, "GET", "/admin/keys/poisoned", auth)
    assert status == 200 and shown["status"] == "unreadable"
    assert call(gateway, "DELETE", "/admin/keys/poisoned", auth)[0] == 200  # the operator can still revoke it
    assert call(gateway, "GET", "/ui", auth)[0] == 200


# ---------------------------------------------------------------------- class 14: keys outlive Redis
@contextmanager
def own_redis(workdir: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """A redis-server without persistence (what a cache-only Redis is), and a function that
    restarts it: it comes back empty."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs redis-server")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    workdir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        procs.append(subprocess.Popen(redis_argv(binary, port, workdir), stdout=subprocess.DEVNULL))
        client = redis_lib.Redis.from_url(url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    return
            except redis_lib.RedisError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def restart() -> None:
        stop_process(procs[-1])
        start()

    try:
        start()
        yield url, restart
    finally:
        for proc in procs:
            stop_process(proc)


def key_works(gateway: Gateway, secret: str) -> bool:
    return call(gateway, "GET", "/v1/key", {"Authorization": f"Bearer {secret}"})[0] == 200


def test_keys_made_through_the_api_survive_a_redis_restart_without_persistence(
    tmp_path: Path, gateway_factory: Callable[..., Gateway]
) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with own_redis(tmp_path / "redis") as (url, restart_redis):
        state = {"backend": "redis", "redis_url": url, "key_prefix": "trust"}
        a = gateway_factory(pools=[], server={"admin_token": TOKEN}, state=state)
        b = gateway_factory(pools=[], server={"admin_token": TOKEN}, state=state)
        assert call(a, "POST", "/admin/tenants", auth, body={"name": "api-tenant"})[0] == 201
        secrets = {}
        for key_id, tenant in (("file-tenant-key", "t1"), ("api-tenant-key", "api-tenant"), ("revoked", "t1")):
            status, _, made = call(a, "POST", "/admin/keys", auth, body={"tenant": tenant, "id": key_id})
            assert status == 201, made
            secrets[key_id] = made["secret"]
        assert call(a, "DELETE", "/admin/keys/revoked", auth)[0] == 200
        wait_for(lambda: key_works(b, secrets["api-tenant-key"]) and not key_works(b, secrets["revoked"]))

        restart_redis()  # comes back empty
        client = redis_lib.Redis.from_url(url)
        wait_for(lambda: client.hlen("{trust}:dir:keys") == 3)  # put back by a replica
        for gateway in (a, b):
            assert key_works(gateway, secrets["file-tenant-key"]) and key_works(gateway, secrets["api-tenant-key"])
            assert not key_works(gateway, secrets["revoked"])
        status, _, made = call(b, "POST", "/admin/keys", auth, body={"tenant": "api-tenant", "id": "after"})
        assert status == 201
        wait_for(lambda: key_works(a, made["secret"]))

        # everything down at once: the replicas, then Redis; a replica starting again restores it
        a.stop()
        b.stop()
        restart_redis()
        assert client.hlen("{trust}:dir:keys") == 0
        again = gateway_factory(pools=[], server={"admin_token": TOKEN}, state=state)
        assert not key_works(again, secrets["api-tenant-key"])  # a new replica, without a copy: nothing to restore
        again.stop()
        revived = start_gateway(
            a.workdir, pools=[], policies=policies_doc(), server={"admin_token": TOKEN}, state=state
        )
        try:
            assert key_works(revived, secrets["api-tenant-key"]) and key_works(revived, made["secret"])
            assert not key_works(revived, secrets["revoked"])
            assert call(revived, "GET", "/admin/tenants/api-tenant", auth)[0] == 200
        finally:
            revived.stop()

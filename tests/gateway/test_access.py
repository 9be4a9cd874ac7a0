"""Who may reach /admin/*, the console and /metrics: loopback, tokens, Host names, proxies,
cross-site pages, console cookies and their CSRF tokens, and login backoff."""

from __future__ import annotations

import pytest

from gateway.console.sessions import Backoff, LoginThrottle
from gateway.errors import InvalidApiKey
from gateway.http.access import (
    CSRF_HEADER,
    Caller,
    CrossSiteRequest,
    CsrfTokenInvalid,
    Gate,
    HostNotAllowed,
    LoopbackOnly,
    admin_refusal,
    exposure_problem,
    host_refusal,
    is_loopback,
    weak_token_reason,
)

TOKEN = "a-strong-admin-token-0123456789"
PORT = 8080
LOCAL = {"Host": f"127.0.0.1:{PORT}"}
OPEN = Gate(None)
GUARDED = Gate(TOKEN)


def caller(method: str = "GET", headers: dict[str, str] | None = None, remote: str | None = "127.0.0.1") -> Caller:
    return Caller(method, {**LOCAL, **(headers or {})}, remote, PORT)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("gateway.internal", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_gateway_beyond_loopback_needs_a_strong_admin_token() -> None:
    problem = exposure_problem("0.0.0.0", None)
    assert problem is not None and "server.admin_token" in problem and "127.0.0.1" in problem
    assert exposure_problem("0.0.0.0", TOKEN) is None
    assert exposure_problem("127.0.0.1", None) is None
    for weak in ("change-me", "CHANGEME", "admin", "password", "secret", "token", "test", "t0ken", "x" * 40,
                 "tokenway-demo-admin"):  # fmt: skip
        problem = exposure_problem("0.0.0.0", weak)
        assert problem is not None and "weak" in problem and repr(weak) not in problem, weak  # never echoes it
        assert exposure_problem("127.0.0.1", weak) is None  # loopback: the operator's own machine
    assert weak_token_reason("short") is not None and weak_token_reason(TOKEN) is None


@pytest.mark.parametrize(
    ("host", "origin", "gate", "refused"),
    [
        pytest.param(f"127.0.0.1:{PORT}", None, OPEN, False, id="loopback-literal"),
        pytest.param(f"localhost:{PORT}", None, OPEN, False, id="localhost"),
        pytest.param(f"[::1]:{PORT}", None, OPEN, False, id="ipv6-loopback"),
        pytest.param(f"127.0.0.1:{PORT}", f"http://localhost:{PORT}", OPEN, False, id="origin-localhost"),
        pytest.param(f"rebind.attacker.example:{PORT}", None, OPEN, True, id="rebinding-host"),
        pytest.param("127.0.0.1:9999", None, OPEN, True, id="another-local-port"),
        pytest.param("127.0.0.1", None, OPEN, True, id="no-port-is-80"),
        pytest.param(None, None, OPEN, True, id="no-host"),
        pytest.param(f"127.0.0.1:{PORT}", "http://rebind.attacker.example", OPEN, True, id="foreign-origin"),
        pytest.param(f"127.0.0.1:{PORT}", "null", OPEN, True, id="null-origin"),
        pytest.param(f"user@127.0.0.1:{PORT}", None, OPEN, True, id="userinfo"),
        pytest.param(f"127.0.0.1:{PORT}x", None, OPEN, True, id="bad-port"),
        pytest.param(f"gw.example.com:{PORT}", None, Gate(None, ("gw.example.com",)), False, id="allowed-name"),
        pytest.param("gw.example.com:1", None, Gate(None, ("gw.example.com:443",)), True, id="allowed-name-port"),
        pytest.param("anything.example", None, GUARDED, False, id="token-without-allowed-hosts"),
        pytest.param("anything.example", None, Gate(TOKEN, ("gw.example.com",)), True, id="token-with-allowed"),
    ],
)
def test_host_names_the_gateway(host: str | None, origin: str | None, gate: Gate, refused: bool) -> None:
    headers = {k: v for k, v in (("Host", host), ("Origin", origin)) if v is not None}
    found = host_refusal(Caller("GET", headers, "127.0.0.1", PORT), gate)
    assert isinstance(found, HostNotAllowed) if refused else found is None
    if refused:
        assert found is not None and found.status == 403 and found.type == "permission_error"


@pytest.mark.parametrize(
    ("method", "headers", "remote", "gate", "refused"),
    [
        pytest.param("GET", {}, "127.0.0.1", OPEN, None, id="loopback-no-token"),
        pytest.param("GET", {}, "10.1.1.1", OPEN, LoopbackOnly, id="remote-no-token"),
        pytest.param("GET", {"X-Forwarded-For": "203.0.113.9"}, "127.0.0.1", OPEN, LoopbackOnly, id="via-proxy"),
        pytest.param("GET", {"Forwarded": "for=203.0.113.9"}, "::1", OPEN, LoopbackOnly, id="via-proxy-forwarded"),
        pytest.param("GET", {"X-Real-IP": "203.0.113.9"}, "127.0.0.1", OPEN, LoopbackOnly, id="via-proxy-real-ip"),
        pytest.param("GET", {"Host": "rebind.attacker.example:8080"}, "127.0.0.1", OPEN, HostNotAllowed, id="rebind"),
        pytest.param("GET", {"Authorization": f"Bearer {TOKEN}"}, "10.1.1.1", GUARDED, None, id="token"),
        pytest.param("GET", {"Authorization": "Bearer wrong"}, "127.0.0.1", GUARDED, InvalidApiKey, id="wrong-token"),
        pytest.param("GET", {"Authorization": "Bearer \udcff"}, "127.0.0.1", GUARDED, InvalidApiKey, id="undecodable"),
        pytest.param("POST", {"Sec-Fetch-Site": "cross-site"}, "127.0.0.1", OPEN, CrossSiteRequest, id="fetch-meta"),
        pytest.param("POST", {"Sec-Fetch-Site": "same-site"}, "127.0.0.1", OPEN, CrossSiteRequest, id="other-port"),
        pytest.param(
            "POST",
            {"Origin": "http://evil.example", "Authorization": f"Bearer {TOKEN}"},
            "127.0.0.1",
            GUARDED,
            CrossSiteRequest,
            id="csrf-origin-with-token",
        ),
        pytest.param("POST", {"Origin": "null"}, "127.0.0.1", GUARDED, CrossSiteRequest, id="csrf-null-origin"),
        pytest.param(
            "POST",
            {"Origin": f"http://127.0.0.1:{PORT}", "Sec-Fetch-Site": "same-origin"},
            "127.0.0.1",
            OPEN,
            None,
            id="same-origin-console",
        ),
        pytest.param("POST", {}, "127.0.0.1", OPEN, None, id="curl"),
        pytest.param("GET", {"Sec-Fetch-Site": "cross-site"}, "127.0.0.1", OPEN, None, id="cross-site-read-allowed"),
    ],
)
def test_admin_refusals(
    method: str, headers: dict[str, str], remote: str, gate: Gate, refused: type[Exception] | None
) -> None:
    found = admin_refusal(caller(method, headers, remote), gate)
    if refused is None:
        assert found is None
    else:
        assert isinstance(found, refused)


def test_a_console_cookie_needs_its_csrf_token_for_changes_and_skips_no_other_check() -> None:
    csrf = "session-csrf-token"
    for gate in (OPEN, GUARDED):
        assert admin_refusal(caller("GET"), gate, csrf) is None  # reads need only the cookie
        assert isinstance(admin_refusal(caller("POST"), gate, csrf), CsrfTokenInvalid)
        assert isinstance(admin_refusal(caller("POST", {CSRF_HEADER: "guess"}), gate, csrf), CsrfTokenInvalid)
        assert isinstance(admin_refusal(caller("POST", {CSRF_HEADER: "1"}), gate, csrf), CsrfTokenInvalid)
        assert admin_refusal(caller("POST", {CSRF_HEADER: csrf}), gate, csrf) is None
        cross = {CSRF_HEADER: csrf, "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
        assert isinstance(admin_refusal(caller("POST", cross), gate, csrf), (CrossSiteRequest, HostNotAllowed))
    rebound = {"Host": "rebind.attacker.example:8080", CSRF_HEADER: csrf}
    assert isinstance(admin_refusal(caller("POST", rebound), OPEN, csrf), HostNotAllowed)
    proxied = {"X-Forwarded-For": "203.0.113.9"}
    assert isinstance(admin_refusal(caller("GET", proxied), OPEN, csrf), LoopbackOnly)  # no loopback via a cookie
    assert admin_refusal(caller("GET", proxied), GUARDED, csrf) is None  # with a token, the cookie is the token
    assert isinstance(admin_refusal(caller("GET", {}, "10.0.0.9"), OPEN, csrf), LoopbackOnly)


def test_login_backoff_per_client_and_overall_with_bounded_memory() -> None:
    now = [0.0]
    throttle = LoginThrottle(
        per_client=Backoff(free_failures=3, base_delay_s=1.0, max_delay_s=60.0, window_s=600.0),
        overall=Backoff(free_failures=20, base_delay_s=1.0, max_delay_s=10.0, window_s=600.0),
        max_clients=8,
        clock=lambda: now[0],
    )
    for _ in range(2):
        assert throttle.failed("a")[1] == 0.0
    assert throttle.retry_after_s("a") == 0.0
    failures, wait_s = throttle.failed("a")
    assert failures == 3 and wait_s == 1.0 and throttle.retry_after_s("a") == 1.0
    assert throttle.retry_after_s("b") == 0.0  # another client is not held back by a's failures
    waits = [throttle.failed("a")[1] for _ in range(10)]
    assert waits == sorted(waits) and waits[-1] == 60.0  # exponential, capped
    now[0] = 60.0
    throttle.succeeded("a")
    assert throttle.retry_after_s("a") == 0.0
    for i in range(100):  # many addresses: the table stays bounded, and the global backoff engages
        throttle.failed(f"10.0.0.{i}")
    assert len(throttle) == 8
    assert 0 < throttle.retry_after_s("fresh-client") <= 10.0
    now[0] = 10_000.0  # windows pass
    assert throttle.retry_after_s("fresh-client") == 0.0
    assert throttle.failed("10.0.0.99")[0] == 1

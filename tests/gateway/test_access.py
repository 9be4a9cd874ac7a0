"""Who may reach /admin/* and /metrics: loopback, tokens, proxies and cross-site pages."""

from __future__ import annotations

import pytest

from gateway.access import CrossSiteRequest, admin_refusal, exposure_problem, is_loopback
from gateway.errors import InvalidApiKey

TOKEN = "t0ken"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("gateway.internal", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_gateway_beyond_loopback_needs_an_admin_token() -> None:
    problem = exposure_problem("0.0.0.0", None)
    assert problem is not None and "server.admin_token" in problem and "127.0.0.1" in problem
    assert exposure_problem("0.0.0.0", TOKEN) is None
    assert exposure_problem("127.0.0.1", None) is None


@pytest.mark.parametrize(
    ("method", "headers", "remote", "token", "refused"),
    [
        pytest.param("GET", {}, "127.0.0.1", None, None, id="loopback-no-token"),
        pytest.param("GET", {}, "10.1.1.1", None, InvalidApiKey, id="remote-no-token"),
        pytest.param("GET", {"X-Forwarded-For": "203.0.113.9"}, "127.0.0.1", None, InvalidApiKey, id="via-proxy"),
        pytest.param("GET", {"Forwarded": "for=203.0.113.9"}, "::1", None, InvalidApiKey, id="via-proxy-forwarded"),
        pytest.param("GET", {"Authorization": f"Bearer {TOKEN}"}, "10.1.1.1", TOKEN, None, id="token"),
        pytest.param("GET", {"Authorization": "Bearer wrong"}, "127.0.0.1", TOKEN, InvalidApiKey, id="wrong-token"),
        pytest.param("GET", {"Authorization": "Bearer \udcff"}, "127.0.0.1", TOKEN, InvalidApiKey, id="undecodable"),
        pytest.param(
            "POST", {"Sec-Fetch-Site": "cross-site"}, "127.0.0.1", None, CrossSiteRequest, id="csrf-fetch-metadata"
        ),
        pytest.param(
            "POST",
            {"Origin": "http://evil.example", "Host": "127.0.0.1:8080", "Authorization": f"Bearer {TOKEN}"},
            "127.0.0.1",
            TOKEN,
            CrossSiteRequest,
            id="csrf-origin-with-token",
        ),
        pytest.param("POST", {"Origin": "null"}, "127.0.0.1", None, CrossSiteRequest, id="csrf-null-origin"),
        pytest.param(
            "POST",
            {"Origin": "http://127.0.0.1:8080", "Host": "127.0.0.1:8080", "Sec-Fetch-Site": "same-origin"},
            "127.0.0.1",
            None,
            None,
            id="same-origin-console",
        ),
        pytest.param("POST", {}, "127.0.0.1", None, None, id="curl"),
        pytest.param("GET", {"Sec-Fetch-Site": "cross-site"}, "127.0.0.1", None, None, id="cross-site-read-allowed"),
    ],
)
def test_admin_refusals(
    method: str, headers: dict[str, str], remote: str, token: str | None, refused: type[Exception] | None
) -> None:
    found = admin_refusal(method, headers, remote, token)
    if refused is None:
        assert found is None
    else:
        assert isinstance(found, refused)

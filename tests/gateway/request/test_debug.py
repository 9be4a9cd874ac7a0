"""The debug headers are answered to operators only."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from gateway.request.intake import debug_allowed

TOKEN = "s3cret-admin-token-0123456789"


def headers(**values: str) -> CIMultiDict[str]:
    return CIMultiDict({name.replace("_", "-"): value for name, value in values.items()})


def test_with_an_admin_token_only_a_request_carrying_it_gets_them() -> None:
    assert debug_allowed(headers(x_tokenway_debug="1", x_tokenway_admin_token=TOKEN), "10.0.0.5", TOKEN)
    assert not debug_allowed(headers(x_tokenway_debug="1"), "127.0.0.1", TOKEN)
    assert not debug_allowed(headers(x_tokenway_debug="1", x_tokenway_admin_token="guess"), "127.0.0.1", TOKEN)


@pytest.mark.parametrize(
    ("remote", "extra", "allowed"),
    [
        ("127.0.0.1", {}, True),
        ("::1", {}, True),
        ("10.0.0.5", {}, False),
        ("127.0.0.1", {"X-Forwarded-For": "203.0.113.9"}, False),  # a same-host proxy relays anyone
        (None, {}, False),  # unknown (the endpoint picker's, behind Envoy)
    ],
)
def test_without_one_only_direct_loopback_callers_get_them(
    remote: str | None, extra: dict[str, str], allowed: bool
) -> None:
    given = headers(x_tokenway_debug="1")
    given.update(extra)
    assert debug_allowed(given, remote, None) is allowed


def test_nobody_gets_them_without_asking() -> None:
    assert not debug_allowed(headers(x_tokenway_admin_token=TOKEN), "127.0.0.1", TOKEN)
    assert not debug_allowed(headers(), "127.0.0.1", None)

"""Who may reach the operator surfaces (`/admin/*`, `/metrics`), decided per request.

- A gateway listening beyond loopback must have `server.admin_token`: `exposure_problem` is checked
  at start-up and the process refuses to serve without one.
- Without a token (loopback only), an admin request is taken as a local operator's only when it
  came straight from a loopback address: one relayed by a reverse proxy on the same host (it carries
  `Forwarded` / `X-Forwarded-For` / `X-Real-IP`) could be anyone's, and is refused.
- State-changing admin requests (anything but GET/HEAD) coming from a browser page of another site
  are refused whatever the credentials (cross-site request forgery): browsers say where a request
  comes from (`Sec-Fetch-Site`, `Origin`); command-line clients send neither and are unaffected.
- `/metrics` names tenants and models: `telemetry.metrics.token` makes it a bearer-token route.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

from gateway.errors import GatewayError, InvalidApiKey

PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Real-IP")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def bearer_token(headers: Mapping[str, str]) -> bytes:
    """The bearer token of `Authorization` as bytes (for a constant-time compare), b"" without one;
    undecodable bytes are kept as they came (`surrogateescape`), so they simply fail the compare."""
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return token.strip().encode("utf-8", "surrogateescape")


class CrossSiteRequest(GatewayError):
    status = 403
    type = "permission_error"
    code = "cross_site_request"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost`; anything else (0.0.0.0, a name, a LAN address) is exposed."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, admin_token: str | None) -> str | None:
    """Why the gateway must not start as configured, or None."""
    if admin_token or is_loopback(host):
        return None
    return (
        f"server.host is {host!r}, which is not a loopback address, and server.admin_token is not set: "
        "/admin/* would be open to the network. Set server.admin_token (e.g. admin_token: "
        "${TOKENWAY_ADMIN_TOKEN}) or bind server.host: 127.0.0.1."
    )


def token_matches(headers: Mapping[str, str], token: str) -> bool:
    return hmac.compare_digest(bearer_token(headers), token.encode("utf-8"))


def admin_refusal(
    method: str, headers: Mapping[str, str], remote: str | None, admin_token: str | None
) -> GatewayError | None:
    """The error an admin request gets, or None when it may proceed."""
    if method.upper() not in SAFE_METHODS and _cross_site(headers):
        return CrossSiteRequest("cross-site requests to the admin API are refused")
    if admin_token:
        if not token_matches(headers, admin_token):
            return InvalidApiKey("admin token required")
        return None
    if remote not in ("127.0.0.1", "::1", None) or any(name in headers for name in PROXY_HEADERS):
        return InvalidApiKey("admin API is loopback-only without server.admin_token (and not through a proxy)")
    return None


def _cross_site(headers: Mapping[str, str]) -> bool:
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site.lower() not in ("same-origin", "none"):
        return True
    origin = headers.get("Origin")
    if origin is None:
        return False
    if origin == "null":  # sandboxed frames, file:// pages, some redirects
        return True
    return urlsplit(origin).netloc.lower() != headers.get("Host", "").lower()

"""Who may reach the operator surfaces (`/admin/*`, the console `/ui/*`, `/metrics`), decided per request.

- A gateway listening beyond loopback must have a strong `server.admin_token`: `exposure_problem`
  is checked at start-up and the process refuses to serve without one, or with a known-weak one
  (short, or a placeholder such as `change-me` that shipped manifests once carried).
- Without a token (loopback only), a request is taken as a local operator's only when it came
  straight from a loopback address: one relayed by a reverse proxy on the same host (it carries
  `Forwarded` / `X-Forwarded-For` / `X-Real-IP`) could be anyone's, and is refused.
- Loopback trust also needs the request to name the gateway: its `Host` (and `Origin`, when sent)
  must be a loopback literal or `localhost` on the port it listens on, or one of
  `server.allowed_hosts`. A page of `rebind.attacker.example`, whose name the attacker re-points at
  127.0.0.1 (DNS rebinding), reaches the socket from the browser but carries its own name, and is
  refused. With an admin token the same check applies once `allowed_hosts` is set.
- State-changing requests (anything but GET/HEAD/OPTIONS) coming from a browser page of another site
  are refused whatever the credentials (cross-site request forgery): browsers say where a request
  comes from (`Sec-Fetch-Site`, `Origin`); command-line clients send neither and are unaffected.
  Requests authenticated by the console's cookie must also carry that session's CSRF token.
- A console cookie stands in for the admin token only: it never lets a request past a check the
  request would fail on its own (Host, Origin, cross-site, proxy).
- `/metrics` names tenants and models: `telemetry.metrics.token` makes it a bearer-token route.
- Who got in is an identity with a role (gateway/http/roles.py): the admin token, a loopback caller
  and a console session opened with the token are `admin`; a user's token of `server.users` (or a
  session that user opened) has that user's role, which the admin guard then checks per route.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.errors import GatewayError, InvalidApiKey
from gateway.http.roles import ADMIN_TOKEN, CONSOLE, LOOPBACK, Identity, Users

PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Real-IP")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CSRF_HEADER = "X-Tokenway-CSRF"
MIN_TOKEN_CHARS = 16
# Tokens that anyone would try first: placeholders of manifests and docs, and the usual guesses.
WEAK_TOKENS = frozenset(
    {"change-me", "changeme", "change_me", "admin", "administrator", "password", "passw0rd", "secret",
     "token", "test", "testing", "tokenway", "tokenway-demo-admin", "default", "letmein", "12345678",
     "1234567890123456", "admin-token", "admin_token", "changeit", "replace-me", "replaceme"}
)  # fmt: skip


class CrossSiteRequest(GatewayError):
    status = 403
    type = "permission_error"
    code = "cross_site_request"


class HostNotAllowed(GatewayError):
    status = 403
    type = "permission_error"
    code = "host_not_allowed"


class CsrfTokenInvalid(GatewayError):
    status = 403
    type = "permission_error"
    code = "csrf_token_invalid"


class LoopbackOnly(GatewayError):
    status = 403
    type = "permission_error"
    code = "loopback_only"


@dataclass(frozen=True, slots=True)
class Gate:
    """What the operator surfaces admit: the admin token and the extra names the gateway answers to."""

    admin_token: str | None
    allowed_hosts: tuple[str, ...] = ()
    users: Users = field(default_factory=Users)  # server.users by token digest (gateway/http/roles.py)

    @property
    def checks_host(self) -> bool:
        """Loopback trust always names the gateway; a token-guarded gateway once names are configured."""
        return not self.admin_token or bool(self.allowed_hosts)


@dataclass(frozen=True, slots=True)
class Caller:
    """The parts of a request the checks read (kept apart from aiohttp so they are tested as data)."""

    method: str
    headers: Mapping[str, str]
    remote: str | None
    local_port: int | None = None  # the port the connection reached (None: unknown, e.g. a unix socket)
    secure: bool = False


def bearer_token(headers: Mapping[str, str]) -> bytes:
    """The bearer token of `Authorization` as bytes (for a constant-time compare), b"" without one;
    undecodable bytes are kept as they came (`surrogateescape`), so they simply fail the compare."""
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return token.strip().encode("utf-8", "surrogateescape")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost`; anything else (0.0.0.0, a name, a LAN address) is exposed."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def weak_token_reason(token: str) -> str | None:
    """Why `token` is too easy to guess for a gateway reachable from the network, or None."""
    if len(token) < MIN_TOKEN_CHARS:
        return f"it is shorter than {MIN_TOKEN_CHARS} characters"
    if token.strip().lower() in WEAK_TOKENS or len(set(token)) < 4:
        return "it is a well-known placeholder or trivially guessable"
    return None


def exposure_problem(host: str, admin_token: str | None) -> str | None:
    """Why the gateway must not start as configured, or None."""
    if is_loopback(host):
        return None
    if not admin_token:
        return (
            f"server.host is {host!r}, which is not a loopback address, and server.admin_token is not set: "
            "/admin/* would be open to the network. Set server.admin_token (e.g. admin_token: "
            "${TOKENWAY_ADMIN_TOKEN}) or bind server.host: 127.0.0.1."
        )
    weak = weak_token_reason(admin_token)
    if weak is not None:
        return (
            f"server.host is {host!r}, which is not a loopback address, and server.admin_token is weak ({weak}): "
            "anyone who can reach the gateway could guess it. Set a random one, e.g. "
            "TOKENWAY_ADMIN_TOKEN=$(openssl rand -hex 24)."
        )
    return None


def token_matches(headers: Mapping[str, str], token: str) -> bool:
    return hmac.compare_digest(bearer_token(headers), token.encode("utf-8"))


def proxied(headers: Mapping[str, str]) -> bool:
    """Whether a reverse proxy relayed the request (its client could be anyone)."""
    return any(name in headers for name in PROXY_HEADERS)


def direct_loopback(caller: Caller) -> bool:
    """Straight from this host: a loopback peer (or a unix socket) and no proxy's headers."""
    if proxied(caller.headers):
        return False
    return caller.remote is None or is_loopback(caller.remote)


def host_refusal(caller: Caller, gate: Gate) -> GatewayError | None:
    """A refusal when the request names a host the gateway does not answer to as (DNS rebinding)."""
    if not gate.checks_host:
        return None
    host = caller.headers.get("Host")
    if host is None or not _names_gateway(host, caller, gate, "https" if caller.secure else "http"):
        return HostNotAllowed(
            "the Host header does not name this gateway (a loopback address on its port, localhost, or one of "
            "server.allowed_hosts); refused to defeat DNS rebinding"
        )
    origin = caller.headers.get("Origin")
    if origin is not None:
        parts = urlsplit(origin) if origin != "null" else None
        if (
            parts is None
            or parts.scheme not in ("http", "https")
            or not _names_gateway(parts.netloc, caller, gate, parts.scheme)
        ):
            return HostNotAllowed("the Origin header does not name this gateway; refused")
    return None


def cross_site(headers: Mapping[str, str]) -> bool:
    """Whether a browser says the request comes from a page of another origin."""
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site.lower() not in ("same-origin", "none"):
        return True
    origin = headers.get("Origin")
    if origin is None:
        return False
    if origin == "null":  # sandboxed frames, file:// pages, some redirects
        return True
    return urlsplit(origin).netloc.lower() != headers.get("Host", "").lower()


def csrf_matches(headers: Mapping[str, str], expected: str) -> bool:
    presented = headers.get(CSRF_HEADER, "").encode("utf-8", "surrogateescape")
    return bool(presented) and hmac.compare_digest(presented, expected.encode("utf-8"))


def surface_refusal(caller: Caller, gate: Gate) -> GatewayError | None:
    """The checks every console and admin request passes before any credential is looked at:
    the host it names, and for state-changing ones, no other site's page behind it."""
    refusal = host_refusal(caller, gate)
    if refusal is not None:
        return refusal
    if caller.method.upper() not in SAFE_METHODS and cross_site(caller.headers):
        return CrossSiteRequest("cross-site requests to the operator surfaces are refused")
    return None


def admin_refusal(caller: Caller, gate: Gate, session_csrf: str | None = None) -> GatewayError | None:
    """The error an admin request gets, or None when it may proceed (`admin_identity` without the
    identity: one order of checks for both).

    `session_csrf` is the CSRF token of the live console session the request's cookie names (None:
    no such cookie). The cookie stands in for the admin token, never for the other checks."""
    found = admin_identity(caller, gate, (session_csrf, CONSOLE) if session_csrf is not None else None)
    return found if isinstance(found, GatewayError) else None


def admin_identity(caller: Caller, gate: Gate, session: tuple[str, Identity] | None = None) -> GatewayError | Identity:
    """Who an admin request is, or the error it gets: the checks of `admin_refusal`, with each
    credential read as the identity it stands for. In the order checked: the admin token (admin), a
    user's token (`server.users`: its role), the console session the cookie names (the identity it
    was opened with; `session` is its CSRF token and identity), and without an admin token, a direct
    loopback caller (admin). A user token is honoured without an admin token too, but only from a
    direct loopback caller: a gateway without a token is never reached from elsewhere."""
    refusal = surface_refusal(caller, gate)
    if refusal is not None:
        return refusal
    if gate.admin_token and token_matches(caller.headers, gate.admin_token):
        return ADMIN_TOKEN
    if not gate.admin_token and not direct_loopback(caller):
        return LoopbackOnly("the admin API is loopback-only without server.admin_token (and not through a proxy)")
    user = gate.users.by_token(bearer_token(caller.headers))
    if user is not None:
        return user
    if session is not None:
        csrf, identity = session
        if caller.method.upper() not in SAFE_METHODS and not csrf_matches(caller.headers, csrf):
            return CsrfTokenInvalid(f"console changes need the session's CSRF token in {CSRF_HEADER}")
        return identity
    if gate.admin_token:
        return InvalidApiKey("admin token or a user token (server.users) required")
    return LOOPBACK


def _names_gateway(netloc: str, caller: Caller, gate: Gate, scheme: str) -> bool:
    try:
        parts = urlsplit("//" + netloc)
        name, port = parts.hostname, parts.port
    except ValueError:
        return False
    if not name or parts.username is not None or parts.password is not None:
        return False
    name = name.rstrip(".").lower()
    port = port if port is not None else (443 if scheme == "https" else 80)
    for allowed in gate.allowed_hosts:
        allowed_name, _, allowed_port = allowed.lower().rpartition(":") if _has_port(allowed) else (allowed, "", "")
        if name == allowed_name.strip("[]").rstrip(".").lower() and (not allowed_port or str(port) == allowed_port):
            return True
    if not is_loopback(name):
        return False
    return caller.local_port is None or port == caller.local_port


def _has_port(entry: str) -> bool:
    """`name:8080` and `[::1]:8080` carry a port; `::1` and `name` do not."""
    if entry.startswith("["):
        return "]:" in entry
    return entry.count(":") == 1

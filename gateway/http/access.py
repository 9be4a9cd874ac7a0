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
- Who got in is an identity with a role (below): the admin token, a loopback caller
  and a console session opened with the token are `admin`; a user's token of `server.users` (or a
  session that user opened) has that user's role, which the admin guard then checks per route.

Roles
-----

Who a caller of the operator surfaces is, once in, (an `Identity`: a name, a role, the teams it manages), and
what each admin route needs of it: one decision, taken in the admin guard before any handler runs.

Roles (issue 45): `admin` may do everything; `viewer` may read (every GET of the admin API); a
`team_admin` reads only its own teams' data and may change the keys and tenants of its own teams only.
What a team admin reads on each admin read is declared in `TEAM_READS` (fleet data as a viewer does,
its teams' rows filtered by the handler through gateway/http/team_scope.py, or nothing); a read the
table does not name is refused to team admins. The shared
`server.admin_token`, a console session opened with it, and a loopback caller of a gateway without a
token are `admin`, as they always were; `server.users` adds people and services with their own tokens.

Every admin route is named in `ROUTE_NEEDS`, by its method and path template. A route missing from the
table needs `admin`: a route added without a thought about roles is refused to everyone else (fail
closed), and `tests/gateway/test_roles.py` walks the router so that no route stays unnamed. A
`team` route admits a team admin only as far as the guard; the key and tenant handlers
(gateway/http/admin.py) then check the target's team, which only they can look up.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal
from urllib.parse import urlsplit

from aiohttp import web

from gateway.app.settings import UserConfig
from gateway.errors import GatewayError, InvalidApiKey

# ---- Roles

Role = Literal["admin", "team_admin", "viewer"]


class Need(Enum):
    """What a route asks of its caller's role."""

    READ = "read"  # viewer, team_admin, admin
    TEAM = "team"  # admin, or a team_admin whose team holds the target (checked by the handler)
    ADMIN = "admin"  # admin only


ROUTE_NEEDS: dict[tuple[str, str], Need] = {
    ("GET", "/admin/backends"): Need.READ,
    ("GET", "/admin/status"): Need.READ,
    ("GET", "/admin/predictor"): Need.READ,
    ("GET", "/admin/predictor/samples"): Need.READ,
    ("POST", "/admin/reload"): Need.ADMIN,
    ("GET", "/admin/replicas"): Need.READ,
    ("GET", "/admin/pools"): Need.READ,
    ("GET", "/admin/pools/{pool}/floor"): Need.READ,
    ("PUT", "/admin/pools/{pool}/floor"): Need.ADMIN,
    ("DELETE", "/admin/pools/{pool}/floor"): Need.ADMIN,
    ("GET", "/admin/keys"): Need.READ,
    ("POST", "/admin/keys"): Need.TEAM,
    ("GET", "/admin/keys/{key_id}"): Need.READ,
    ("PATCH", "/admin/keys/{key_id}"): Need.TEAM,
    ("DELETE", "/admin/keys/{key_id}"): Need.TEAM,
    ("POST", "/admin/keys/{key_id}/rotate"): Need.TEAM,
    ("GET", "/admin/tenants"): Need.READ,
    ("POST", "/admin/tenants"): Need.TEAM,
    ("GET", "/admin/tenants/{name}"): Need.READ,
    ("PATCH", "/admin/tenants/{name}"): Need.TEAM,
    ("DELETE", "/admin/tenants/{name}"): Need.TEAM,
    ("GET", "/admin/activity"): Need.READ,
    ("GET", "/admin/usage"): Need.READ,
    ("GET", "/admin/programs"): Need.READ,  # a team admin: its teams' runs only (gateway/console/programs.py)
    ("POST", "/admin/models/{model}/check"): Need.ADMIN,
    ("GET", "/admin/adapters"): Need.READ,
    ("GET", "/admin/audit"): Need.READ,
    ("GET", "/admin/overrides"): Need.READ,
    ("POST", "/admin/overrides"): Need.ADMIN,
    ("DELETE", "/admin/overrides/{override_id}"): Need.ADMIN,
}


class Reach(Enum):
    """What a team admin reads on an admin `GET` route (a viewer and an admin read it whole)."""

    FLEET = "fleet"  # nothing per tenant or key (replicas, pools, the predictor): read as a viewer does
    TEAM = "team"  # per-tenant or per-key data: the handler keeps its teams' only (gateway/http/team_scope.py)
    NONE = "none"  # refused (403): data of every team that cannot be split by team


# What a team admin reads on each admin read. A read missing from this table is refused to team admins
# (fail closed: a new route that returns every tenant's rows cannot leak them before someone decides),
# and tests/e2e/test_team_scope.py walks every documented admin read as a team admin, asserting that
# no other team's tenant or key appears in any answer.
TEAM_READS: dict[tuple[str, str], Reach] = {
    ("GET", "/admin/backends"): Reach.FLEET,
    ("GET", "/admin/status"): Reach.TEAM,
    ("GET", "/admin/predictor"): Reach.FLEET,
    ("GET", "/admin/predictor/samples"): Reach.FLEET,
    ("GET", "/admin/replicas"): Reach.FLEET,
    ("GET", "/admin/pools"): Reach.FLEET,
    ("GET", "/admin/pools/{pool}/floor"): Reach.FLEET,
    ("GET", "/admin/adapters"): Reach.FLEET,  # adapters per replica: fleet state, no tenant's traffic
    ("GET", "/admin/keys"): Reach.TEAM,
    ("GET", "/admin/keys/{key_id}"): Reach.TEAM,
    ("GET", "/admin/tenants"): Reach.TEAM,
    ("GET", "/admin/tenants/{name}"): Reach.TEAM,
    ("GET", "/admin/activity"): Reach.TEAM,
    ("GET", "/admin/usage"): Reach.TEAM,
    ("GET", "/admin/programs"): Reach.TEAM,
    ("GET", "/admin/audit"): Reach.TEAM,
    ("GET", "/admin/overrides"): Reach.TEAM,
}


class RoleForbidden(GatewayError):
    """403 in the admin API's (OpenAI's) error shape: the caller is known, its role may not."""

    status = 403
    type = "permission_error"
    code = "role_forbidden"


@dataclass(frozen=True, slots=True)
class Identity:
    """A caller admitted to the operator surfaces. `actor` is how the audit log names it."""

    actor: str
    role: Role
    teams: frozenset[str] = field(default_factory=frozenset)
    user: str | None = None  # the name in server.users (None: the admin token or a loopback operator)

    @property
    def team_scope(self) -> frozenset[str] | None:
        """The teams whose keys and tenants it may see and change: None for all (admin, viewer)."""
        return self.teams if self.role == "team_admin" else None

    def view(self) -> dict[str, object]:
        """What the console shows (and hides buttons by): never a token or its digest."""
        return {"actor": self.actor, "role": self.role, "teams": sorted(self.teams), "user": self.user}


ADMIN_TOKEN = Identity("admin-token", "admin")
CONSOLE = Identity("console", "admin")  # a console session opened with the admin token (or from loopback)
LOOPBACK = Identity("loopback", "admin")


def user_identity(user: UserConfig) -> Identity:
    return Identity(f"user:{user.name}", user.role, frozenset(user.teams), user.name)


@dataclass(frozen=True, slots=True)
class Users:
    """`server.users` by token digest and by email, built once per settings (the lookups are dict
    reads keyed by a SHA-256 of the presented token, so the table is bounded by the configuration)."""

    by_digest: Mapping[str, Identity] = field(default_factory=dict)
    by_email: Mapping[str, Identity] = field(default_factory=dict)

    @classmethod
    def of(cls, users: Iterable[UserConfig]) -> Users:
        by_digest: dict[str, Identity] = {}
        by_email: dict[str, Identity] = {}
        for user in users:
            identity = user_identity(user)
            for digest in user.tokens_sha256:
                by_digest[digest] = identity
            for email in user.emails:
                by_email[email] = identity
        return cls(by_digest, by_email)

    def by_token(self, token: bytes) -> Identity | None:
        """The user one of whose tokens is `token`. The lookup is by the token's SHA-256, as for API
        keys (policies/keys): its timing can tell at most about a digest, never about the token."""
        if not token or not self.by_digest:
            return None
        return self.by_digest.get(hashlib.sha256(token).hexdigest())


def need_of(method: str, route: str) -> Need:
    """The need of a route (by its method and path template); an undeclared one needs admin."""
    method = "GET" if method.upper() == "HEAD" else method.upper()
    return ROUTE_NEEDS.get((method, route), Need.ADMIN)


def reach_of(method: str, route: str) -> Reach:
    """What a team admin reads on a route (by its method and path template); undeclared: nothing."""
    method = "GET" if method.upper() == "HEAD" else method.upper()
    return TEAM_READS.get((method, route), Reach.NONE)


def role_refusal(identity: Identity, method: str, route: str) -> GatewayError | None:
    """The one decision: may `identity` call `method route`? None when it may (a team route still has
    its target checked by the handler, and a team admin's read is filtered to its teams by it)."""
    need = need_of(method, route)
    if identity.role == "admin":
        return None
    if need is Need.READ and (identity.role == "viewer" or reach_of(method, route) is not Reach.NONE):
        return None
    if need is Need.READ:
        teams = ", ".join(sorted(identity.teams))
        return RoleForbidden(
            f"{identity.actor} has role team_admin (teams {teams}); {method.upper()} {route} "
            "shows every team's data, which only viewers and admins read"
        )
    if need is Need.TEAM and identity.role == "team_admin":
        return None
    return RoleForbidden(f"{identity.actor} has role {identity.role}, which may not {method.upper()} {route}")


# --------------------------------------------------------------------- the identity on a request
IDENTITY: web.RequestKey[Identity] = web.RequestKey("tokenway_identity", Identity)


def identity_of(request: web.Request) -> Identity:
    """The identity the admin guard admitted (a handler reached without the guard is an admin's: the
    unit tests of handlers, which call them directly)."""
    found = request.get(IDENTITY)
    return found if isinstance(found, Identity) else ADMIN_TOKEN


def may_manage_team(request: web.Request, team: str | None) -> bool:
    """Whether the caller may change what belongs to `team` (None: no team, which only admins own)."""
    scope = identity_of(request).team_scope
    return scope is None or (team is not None and team in scope)


def team_refusal(request: web.Request, team: str | None, what: str) -> GatewayError | None:
    """A 403 when the caller is a team admin and `what` is not of one of its teams."""
    if may_manage_team(request, team):
        return None
    identity = identity_of(request)
    teams = ", ".join(sorted(identity.teams))
    owner = f"team {team!r}" if team is not None else "no team"
    return RoleForbidden(f"{what}: {owner} is not one of the teams {identity.actor} manages ({teams})")


# ---- Access

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
    users: Users = field(default_factory=Users)  # server.users by token digest (gateway/http/access.py)

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

"""Who a caller of the operator surfaces is (an `Identity`: a name, a role, the teams it manages), and
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
(gateway/http/admin_keys.py) then check the target's team, which only they can look up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from aiohttp import web

from gateway.app.schema import UserConfig
from gateway.errors import GatewayError

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

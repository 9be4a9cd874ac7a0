"""Roles on the operator surfaces (gateway/http/access.py): every admin route the router serves declares
what it needs, the one decision reads that table (a route it does not name is admin-only), and each
credential is read as the identity it stands for (admin token, user token, console session, loopback)."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from gateway.app.factory import create_app
from gateway.app.settings import GatewaySettings, ServerSettings, UserConfig
from gateway.errors import InvalidApiKey
from gateway.http.access import (
    ADMIN_TOKEN,
    CONSOLE,
    LOOPBACK,
    ROUTE_NEEDS,
    TEAM_READS,
    Caller,
    CsrfTokenInvalid,
    Gate,
    Identity,
    LoopbackOnly,
    Need,
    Reach,
    RoleForbidden,
    Users,
    admin_identity,
    need_of,
    reach_of,
    role_refusal,
)

TOKEN = "an-admin-token-of-some-length"
VIEWER_TOKEN = "twu-viewer-token"
TEAM_TOKEN = "twu-team-admin-token"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


USERS = [
    UserConfig(name="vera", role="viewer", tokens_sha256=[digest(VIEWER_TOKEN)]),
    UserConfig(name="tom", role="team_admin", teams=["search"], tokens_sha256=[digest(TEAM_TOKEN)]),
]
VIEWER = Identity("user:vera", "viewer", frozenset(), "vera")
TEAM_ADMIN = Identity("user:tom", "team_admin", frozenset({"search"}), "tom")


def admin_routes() -> set[tuple[str, str]]:
    app = create_app(GatewaySettings())  # the default configuration; nothing starts until the app runs
    found: set[tuple[str, str]] = set()
    for route in app.router.routes():
        resource = route.resource
        if resource is not None and resource.canonical.startswith("/admin") and route.method != "HEAD":
            found.add((route.method, resource.canonical))
    return found


def test_every_admin_route_declares_its_need_and_every_declared_route_is_served() -> None:
    served = admin_routes()
    assert served, "the walk found no admin route"
    assert served - set(ROUTE_NEEDS) == set(), "admin routes without a need (declare them in access.ROUTE_NEEDS)"
    assert set(ROUTE_NEEDS) - served == set(), "needs declared for routes the gateway does not serve"
    for method, path in served:  # reads are for viewers, and no write is
        assert (ROUTE_NEEDS[(method, path)] is Need.READ) == (method == "GET"), (method, path)


def test_an_undeclared_route_is_admin_only() -> None:
    assert need_of("POST", "/admin/new-thing") is Need.ADMIN
    assert need_of("GET", "/admin/new-thing") is Need.ADMIN
    for identity in (VIEWER, TEAM_ADMIN):
        assert isinstance(role_refusal(identity, "GET", "/admin/new-thing"), RoleForbidden)
    assert role_refusal(ADMIN_TOKEN, "DELETE", "/admin/new-thing") is None


@pytest.mark.parametrize("method, path", sorted(ROUTE_NEEDS))
def test_each_role_on_each_route(method: str, path: str) -> None:
    need = ROUTE_NEEDS[(method, path)]
    for admin in (ADMIN_TOKEN, CONSOLE, LOOPBACK, Identity("user:ann", "admin", user="ann")):
        assert role_refusal(admin, method, path) is None
    assert (role_refusal(VIEWER, method, path) is None) == (need is Need.READ)
    team_reads = need is Need.READ and reach_of(method, path) is not Reach.NONE  # TEAM_READS decides
    assert (role_refusal(TEAM_ADMIN, method, path) is None) == (team_reads or need is Need.TEAM)
    refusal = role_refusal(VIEWER, method, path)
    if refusal is not None:
        assert refusal.status == 403 and refusal.code == "role_forbidden"


def test_key_and_tenant_writes_are_the_team_admins_and_nothing_else_is() -> None:
    team_routes = {route for route, need in ROUTE_NEEDS.items() if need is Need.TEAM}
    assert team_routes and all(path.startswith(("/admin/keys", "/admin/tenants")) for _, path in team_routes)
    assert need_of("POST", "/admin/reload") is Need.ADMIN
    assert need_of("PUT", "/admin/pools/{pool}/floor") is Need.ADMIN


def caller(method: str = "GET", token: str | None = None, remote: str = "127.0.0.1") -> Caller:
    headers = {"Host": "127.0.0.1:8080"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return Caller(method, headers, remote, 8080)


def test_each_credential_is_read_as_its_identity() -> None:
    gate = Gate(TOKEN, (), Users.of(USERS))
    assert admin_identity(caller(token=TOKEN), gate) is ADMIN_TOKEN
    assert admin_identity(caller(token=VIEWER_TOKEN), gate) == VIEWER
    assert admin_identity(caller("PATCH", token=TEAM_TOKEN), gate) == TEAM_ADMIN
    assert isinstance(admin_identity(caller(token="twu-nobody"), gate), InvalidApiKey)
    assert isinstance(admin_identity(caller(), gate), InvalidApiKey)
    session = ("csrf-token", TEAM_ADMIN)  # a console session keeps who opened it
    assert admin_identity(caller(), gate, session) == TEAM_ADMIN
    assert isinstance(admin_identity(caller("POST"), gate, session), CsrfTokenInvalid)


def test_without_an_admin_token_user_tokens_still_name_their_user_but_only_from_loopback() -> None:
    gate = Gate(None, (), Users.of(USERS))
    assert admin_identity(caller(), gate) is LOOPBACK
    assert admin_identity(caller(token=VIEWER_TOKEN), gate) == VIEWER  # a role, not loopback's admin
    assert isinstance(admin_identity(caller(token=VIEWER_TOKEN, remote="10.0.0.7"), gate), LoopbackOnly)


def test_the_users_configuration_is_checked() -> None:
    with pytest.raises(ValidationError, match="team_admin names the teams"):
        ServerSettings(users=[UserConfig(name="tom", role="team_admin")])
    with pytest.raises(ValidationError, match="64 hex"):
        UserConfig(name="x", role="viewer", tokens_sha256=["abc"])
    with pytest.raises(ValidationError, match="listed twice"):
        ServerSettings(users=[USERS[0], USERS[0]])
    with pytest.raises(ValidationError):
        UserConfig(name="x", role="owner")  # type: ignore[arg-type]
    upper = UserConfig(name="x", role="viewer", tokens_sha256=[digest("t").upper()], emails=["X@Example.COM"])
    assert Users.of([upper]).by_token(b"t") is not None and "x@example.com" in Users.of([upper]).by_email


def test_the_cli_mints_a_token_whose_digest_it_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.app.cli import main

    assert main(["users", "token", "tom", "--role", "team_admin", "--teams", "search"]) == 0
    out = capsys.readouterr().out
    token = out.split("shown once; give it to tom): ")[1].split()[0]
    assert token.startswith("twu-") and digest(token) in out and "team_admin" in out and "- search" in out


def test_the_openapi_document_names_each_admin_operations_role() -> None:
    from gateway.http.openapi import operations

    admin_ops = [(m, p, op) for m, p, op in operations() if op["x-tokenway-auth"] == "admin"]
    assert admin_ops
    for method, path, op in admin_ops:
        assert op["x-tokenway-role"] == ROUTE_NEEDS[(method, path)].value, (method, path)


def test_tokenway_check_warns_of_a_team_policies_yaml_lacks() -> None:
    from gateway.app.checks import config_findings
    from policies.schema import PoliciesConfig

    settings = GatewaySettings(server=ServerSettings(users=[USERS[1]]))
    found = config_findings(settings, PoliciesConfig.model_validate({"teams": {"ads": {}}}))
    assert [(f.severity, f.where.split(": ")[-1]) for f in found if "manages nothing" in f.message] == [
        ("warning", "server.users[0].teams")
    ]
    assert not [
        f
        for f in config_findings(settings, PoliciesConfig.model_validate({"teams": {"search": {}}}))
        if "manages" in f.message
    ]


def test_team_reads_name_served_reads_and_an_undeclared_read_is_refused_to_team_admins_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a team admin reads is declared per read (access.TEAM_READS); a read added without a thought
    about team admins is refused to them (fail closed), never to viewers."""
    reads = {route for route, need in ROUTE_NEEDS.items() if need is Need.READ}
    assert set(TEAM_READS) <= reads, "TEAM_READS names a route that is not a read"
    monkeypatch.setitem(ROUTE_NEEDS, ("GET", "/admin/new-read"), Need.READ)
    assert reach_of("GET", "/admin/new-read") is Reach.NONE
    assert role_refusal(VIEWER, "GET", "/admin/new-read") is None
    refusal = role_refusal(TEAM_ADMIN, "GET", "/admin/new-read")
    assert isinstance(refusal, RoleForbidden) and "viewers and admins" in str(refusal)
    monkeypatch.setitem(TEAM_READS, ("GET", "/admin/new-read"), Reach.TEAM)
    assert role_refusal(TEAM_ADMIN, "GET", "/admin/new-read") is None


def test_the_openapi_document_names_what_a_team_admin_reads() -> None:
    from gateway.http.openapi import operations

    for method, path, op in operations():
        if op["x-tokenway-auth"] == "admin" and method == "GET":
            assert op["x-tokenway-team-scope"] == reach_of(method, path).value, path
        else:
            assert "x-tokenway-team-scope" not in op, (method, path)

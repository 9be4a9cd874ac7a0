"""Roles on a real gateway process (issue 45): users of `server.users` call the admin API with their own
tokens; a viewer reads and cannot write, a team admin changes its team's keys and tenants and is
refused (403, the admin API's error shape) another team's, an admin user does everything; the audit
log names each change's user; and a console session opened with a user's token keeps that role."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.procs import Gateway, SimEngines, policies_doc, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LLAMA = "llama-3.1-8b"
ADMIN_TOKEN = "roles-test-admin-token-0123456789"
TOKENS = {"ann": "twu-ann-admin-token", "vera": "twu-vera-viewer-token", "tom": "twu-tom-search-admin-token"}
POLICY = policies_doc(
    teams={"search": {}, "ads": {}},
    tenants={"search-web": {"team": "search"}, "ads-bid": {"team": "ads"}},
    keys=[],
)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


USERS = [
    {"name": "ann", "role": "admin", "tokens_sha256": [digest(TOKENS["ann"])]},
    {"name": "vera", "role": "viewer", "tokens_sha256": [digest(TOKENS["vera"])]},
    {"name": "tom", "role": "team_admin", "teams": ["search"], "tokens_sha256": [digest(TOKENS["tom"])]},
]


def call(
    gateway: Gateway, token: str | None, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(gateway.url + path, data=data, method=method, headers=headers or {})
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


@pytest.fixture
def gateway(sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]) -> Gateway:
    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    gateway = gateway_factory(
        pools=[static_pool("p", LLAMA, engines.urls)],
        policies=POLICY,
        server={"admin_token": ADMIN_TOKEN, "users": USERS},
    )
    for tenant, key in (("search-web", "search-1"), ("ads-bid", "ads-1")):
        status, _, _ = call(gateway, ADMIN_TOKEN, "POST", "/admin/keys", {"tenant": tenant, "id": key})
        assert status == 201
    return gateway


def forbidden(found: tuple[int, Any, Any]) -> bool:
    status, body, _ = found
    return status == 403 and body["error"]["type"] == "permission_error" and body["error"]["code"] == "role_forbidden"


def test_a_viewer_reads_everything_and_changes_nothing(gateway: Gateway) -> None:
    vera = TOKENS["vera"]
    for path in ("/admin/status", "/admin/backends", "/admin/keys", "/admin/tenants", "/admin/audit"):
        assert call(gateway, vera, "GET", path)[0] == 200, path
    keys = call(gateway, vera, "GET", "/admin/keys")[1]
    assert {k["id"] for k in keys["data"]} == {"search-1", "ads-1"}
    assert forbidden(call(gateway, vera, "POST", "/admin/keys", {"tenant": "search-web"}))
    assert forbidden(call(gateway, vera, "PATCH", "/admin/keys/search-1", {"limits": {"rpm": 5}}))
    assert forbidden(call(gateway, vera, "DELETE", "/admin/keys/search-1"))
    assert forbidden(call(gateway, vera, "POST", "/admin/reload"))
    assert forbidden(call(gateway, vera, "PUT", "/admin/pools/p/floor", {"min_replicas": 1, "for_s": 60}))
    assert call(gateway, "twu-not-a-user", "GET", "/admin/keys")[0] == 401


def test_a_team_admin_manages_its_team_and_is_refused_another_teams_key(gateway: Gateway) -> None:
    tom = TOKENS["tom"]
    status, keys, _ = call(gateway, tom, "GET", "/admin/keys")
    assert status == 200 and [k["id"] for k in keys["data"]] == ["search-1"]  # its team's only
    tenants = call(gateway, tom, "GET", "/admin/tenants")[1]
    assert [t["name"] for t in tenants["data"]] == ["search-web"]

    status, changed, _ = call(gateway, tom, "PATCH", "/admin/keys/search-1", {"limits": {"rpm": 7}})
    assert status == 200 and changed["limits"]["rpm"] == 7
    assert call(gateway, tom, "POST", "/admin/keys/search-1/rotate", {"grace_s": 0})[0] == 200
    status, made, _ = call(gateway, tom, "POST", "/admin/keys", {"tenant": "search-web", "id": "search-2"})
    assert status == 201 and made["secret"].startswith("tw-")

    assert forbidden(call(gateway, tom, "PATCH", "/admin/keys/ads-1", {"limits": {"rpm": 1}}))
    assert forbidden(call(gateway, tom, "DELETE", "/admin/keys/ads-1"))
    assert forbidden(call(gateway, tom, "POST", "/admin/keys/ads-1/rotate"))
    assert forbidden(call(gateway, tom, "GET", "/admin/keys/ads-1"))
    assert forbidden(call(gateway, tom, "POST", "/admin/keys", {"tenant": "ads-bid", "id": "ads-2"}))
    assert forbidden(call(gateway, tom, "GET", "/admin/tenants/ads-bid"))
    body = call(gateway, tom, "PATCH", "/admin/keys/ads-1", {"limits": {"rpm": 1}})[1]
    assert "team 'ads'" in body["error"]["message"] and "user:tom" in body["error"]["message"]

    assert forbidden(call(gateway, tom, "POST", "/admin/tenants", {"name": "loose"}))  # of no team
    assert forbidden(call(gateway, tom, "POST", "/admin/tenants", {"name": "ads-new", "team": "ads"}))
    assert call(gateway, tom, "POST", "/admin/tenants", {"name": "search-img", "team": "search"})[0] == 201
    assert forbidden(call(gateway, tom, "PATCH", "/admin/tenants/search-img", {"team": "ads"}))
    assert call(gateway, tom, "PATCH", "/admin/tenants/search-img", {"limits": {"rpm": 9}})[0] == 200
    assert call(gateway, tom, "DELETE", "/admin/tenants/search-img")[0] == 200
    assert forbidden(call(gateway, tom, "POST", "/admin/reload"))

    status, ads_key, _ = call(gateway, ADMIN_TOKEN, "GET", "/admin/keys/ads-1")
    assert status == 200 and ads_key["status"] == "active" and not ads_key["limits"]  # untouched
    status, audit, _ = call(gateway, ADMIN_TOKEN, "GET", "/admin/audit?actor=user:tom")
    assert status == 200
    assert {(r["action"], r["target"]) for r in audit["data"]} >= {
        ("PATCH /admin/keys/{key_id}", "search-1"),
        ("POST /admin/keys", "search-2"),
    }


def test_an_admin_user_does_everything(gateway: Gateway) -> None:
    ann = TOKENS["ann"]
    assert call(gateway, ann, "POST", "/admin/reload")[0] == 200
    assert call(gateway, ann, "PATCH", "/admin/keys/ads-1", {"limits": {"rpm": 3}})[0] == 200
    assert call(gateway, ann, "DELETE", "/admin/keys/search-1")[0] == 200
    status, audit, _ = call(gateway, ADMIN_TOKEN, "GET", "/admin/audit?actor=user:ann")
    assert status == 200 and len(audit["data"]) == 3


def test_a_console_session_opened_with_a_users_token_keeps_its_role(gateway: Gateway) -> None:
    status, login, headers = call(gateway, None, "POST", "/ui/login", {"token": TOKENS["tom"]})
    assert status == 200 and login["identity"] == {
        "actor": "user:tom",
        "role": "team_admin",
        "teams": ["search"],
        "user": "tom",
    }
    cookie = headers["Set-Cookie"].split(";")[0]
    session = {"Cookie": cookie, "X-Tokenway-CSRF": login["csrf_token"]}
    assert call(gateway, None, "GET", "/ui/session", headers=session)[1]["identity"]["role"] == "team_admin"
    assert forbidden(call(gateway, None, "PATCH", "/admin/keys/ads-1", {"limits": {"rpm": 1}}, session))
    assert call(gateway, None, "PATCH", "/admin/keys/search-1", {"limits": {"rpm": 2}}, session)[0] == 200
    audit = call(gateway, ADMIN_TOKEN, "GET", "/admin/audit?target=search-1")[1]
    assert audit["data"][0]["actor"] == "user:tom"


def test_every_admin_route_of_the_document_checks_the_role(gateway: Gateway) -> None:
    """The whole admin surface, walked from /openapi.json: a viewer is refused every write before its
    handler runs (no body needed) and no read; a team admin is refused every write that is not a key's
    or a tenant's, and no read the roles table lets it make (its teams' rows: tests/e2e/test_team_scope.py)."""
    from gateway.http.openapi import operations

    others = {"key_id": "ads-1", "name": "ads-bid", "pool": "p", "override_id": "none", "model": "none"}
    own = {**others, "key_id": "search-1", "name": "search-web"}
    admin_ops = [(m, p, op) for m, p, op in operations() if op["x-tokenway-auth"] == "admin"]
    assert len(admin_ops) >= 20
    for method, template, op in admin_ops:
        role = op["x-tokenway-role"]
        found = call(gateway, TOKENS["vera"], method, template.format(**others))
        assert forbidden(found) == (role != "read"), ("vera", method, template, found[:2])
        if role != "team":
            found = call(gateway, TOKENS["tom"], method, template.format(**own))
            refused = role == "admin" or op.get("x-tokenway-team-scope") == "none"  # test_team_scope.py
            assert forbidden(found) == refused, ("tom", method, template, found[:2])

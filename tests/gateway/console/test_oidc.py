"""The console's OpenID Connect relying party (gateway/console/sessions.py) against a real provider on a
loopback port (tests/support/oidc_provider.py): PKCE, state bound to the browser, the ID token's
signature, issuer, audience, expiry and nonce; and the mapping of a verified login to a role."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest

from gateway.app.settings import OidcConfig, OidcGroupRole, UserConfig
from gateway.console.sessions import OidcClient, OidcProviderFailed, OidcRefused, identity_of_claims
from gateway.http.access import Users
from tests.support.oidc_provider import Provider, oidc_provider

CLIENT_ID, SECRET = "tokenway-console", "a-client-secret"
REDIRECT = "http://127.0.0.1:9/ui/oidc/callback"
USERS = {
    "alice": {"email": "alice@example.com", "email_verified": True, "groups": ["search-leads", "staff"]},
    "mallory": {"email": "bob@example.com", "email_verified": False, "groups": []},
}


@pytest.fixture
def provider() -> Iterator[Provider]:
    with oidc_provider(CLIENT_ID, SECRET, USERS) as found:
        found.redirect_uris.append(REDIRECT)
        yield found


def config(provider: Provider, **extra: Any) -> OidcConfig:
    return OidcConfig(issuer=provider.issuer, client_id=CLIENT_ID, client_secret=SECRET, **extra)


async def log_in(client: OidcClient, http: aiohttp.ClientSession, user: str) -> tuple[dict[str, str], str]:
    """What a browser does between the two steps: follow the authorization URL, sign in, and come
    back with the callback's query (and the flow cookie the gateway gave it)."""
    url, cookie = await client.begin(http, REDIRECT)
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    assert query["code_challenge_method"] == "S256" and len(query["code_challenge"]) == 43
    assert query["state"] and query["nonce"] and query["state"] != query["nonce"]
    async with http.post(url.split("?")[0], data={**query, "username": user}, allow_redirects=False) as answer:
        assert answer.status == 302, await answer.text()
        back = answer.headers["Location"]
    assert back.startswith(REDIRECT)
    return {k: v[0] for k, v in parse_qs(urlsplit(back).query).items()}, cookie


async def test_a_login_yields_verified_claims_once(provider: Provider) -> None:
    client = OidcClient(config(provider))
    async with aiohttp.ClientSession() as http:
        callback, cookie = await log_in(client, http, "alice")
        claims = await client.finish(http, callback, cookie)
        assert claims["sub"] == "sub-alice" and claims["aud"] == CLIENT_ID and claims["iss"] == provider.issuer
        assert provider.token_requests[-1]["code_verifier"]  # PKCE verifier sent (the provider checked it)
        assert "client_secret" not in provider.token_requests[-1]  # client_secret_basic
        with pytest.raises(OidcRefused, match="already used"):  # the state is good once
            await client.finish(http, callback, cookie)


async def test_a_callback_from_another_browser_is_refused(provider: Provider) -> None:
    client = OidcClient(config(provider))
    async with aiohttp.ClientSession() as http:
        callback, _ = await log_in(client, http, "alice")
        with pytest.raises(OidcRefused, match="another browser"):
            await client.finish(http, callback, "the-attackers-cookie")
        with pytest.raises(OidcRefused, match="not started here"):
            await client.finish(http, {"state": "made-up", "code": "x"}, "c")


@pytest.mark.parametrize(
    "tamper, why",
    [
        ("key", "signature"),
        ("audience", "aud"),
        ("nonce", "nonce"),
        ("expired", "exp"),
        ("issuer", "iss"),
    ],
)
async def test_a_token_that_is_not_this_logins_is_refused(provider: Provider, tamper: str, why: str) -> None:
    client = OidcClient(config(provider))
    provider.tamper = tamper
    async with aiohttp.ClientSession() as http:
        callback, cookie = await log_in(client, http, "alice")
        with pytest.raises(OidcRefused, match=why):
            await client.finish(http, callback, cookie)


async def test_a_wrong_client_secret_fails_the_exchange(provider: Provider) -> None:
    client = OidcClient(OidcConfig(issuer=provider.issuer, client_id=CLIENT_ID, client_secret="wrong"))
    async with aiohttp.ClientSession() as http:
        callback, cookie = await log_in(client, http, "alice")
        with pytest.raises(OidcRefused, match="invalid_client"):
            await client.finish(http, callback, cookie)


async def test_an_issuer_that_is_not_a_provider_is_a_502() -> None:
    client = OidcClient(OidcConfig(issuer="http://127.0.0.1:9", client_id=CLIENT_ID, timeout_s=2))
    async with aiohttp.ClientSession() as http:
        with pytest.raises(OidcProviderFailed) as found:
            await client.begin(http, REDIRECT)
    assert found.value.status == 502


def test_claims_map_to_a_user_by_verified_email_else_to_the_highest_group_role() -> None:
    users = Users.of([UserConfig(name="bob", role="admin", emails=["Bob@Example.com"])])
    settings = OidcConfig(
        issuer="https://idp.example",
        client_id=CLIENT_ID,
        group_roles={
            "staff": OidcGroupRole(role="viewer"),
            "search-leads": OidcGroupRole(role="team_admin", teams=["search"]),
            "ads-leads": OidcGroupRole(role="team_admin", teams=["ads"]),
        },
    )
    bob = identity_of_claims({"sub": "1", "email": "bob@example.com", "email_verified": True}, settings, users)
    assert bob is not None and bob.actor == "user:bob" and bob.role == "admin"
    unverified = {"sub": "1", "email": "bob@example.com", "email_verified": False}
    assert identity_of_claims(unverified, settings, users) is None  # an unverified email names no one
    lead = identity_of_claims(
        {"sub": "2", "email": "a@x", "groups": ["staff", "search-leads", "ads-leads"]}, settings, users
    )
    assert lead is not None and lead.role == "team_admin" and lead.teams == {"search", "ads"}
    assert lead.actor == "oidc:a@x"
    viewer = identity_of_claims({"sub": "3", "groups": "staff"}, settings, users)
    assert viewer is not None and viewer.role == "viewer" and viewer.actor == "oidc:3"
    assert identity_of_claims({"sub": "4", "groups": ["unknown"]}, settings, users) is None


def test_the_configuration_refuses_a_plain_http_provider_beyond_loopback() -> None:
    with pytest.raises(ValueError, match="https"):
        OidcConfig(issuer="http://idp.example", client_id=CLIENT_ID)
    with pytest.raises(ValueError, match="callback"):
        OidcConfig(issuer="https://idp.example", client_id=CLIENT_ID, redirect_url="https://gw.example/cb")
    with pytest.raises(ValueError):
        OidcConfig(issuer="https://idp.example", client_id=CLIENT_ID, algorithms=["HS256"])  # type: ignore[list-item]

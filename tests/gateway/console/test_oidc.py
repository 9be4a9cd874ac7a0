"""The console's OpenID Connect relying party (gateway/console/sessions.py) against a real provider on a
loopback port (tests/support/oidc_provider.py): PKCE, state bound to the browser, the ID token's
signature, issuer, audience, expiry and nonce; and the mapping of a verified login to a role."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest

from gateway.app.settings import OidcConfig, OidcGroupRole, UserConfig
from gateway.console.sessions import OidcBadRequest, OidcClient, OidcProviderFailed, OidcRefused, identity_of_claims
from gateway.errors import error_response
from gateway.http.access import Users
from tests.support.oidc_provider import Provider, discovery_document, oidc_provider

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


# What the provider answers is input too (bench/chaos/control_fuzz.py): each answer below once ended
# the login in a 500 (an exception no handler expected) or in a session it should not have opened.


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


async def _login_fails(provider: Provider, expected: type[Exception], match: str) -> None:
    client = OidcClient(config(provider))
    async with aiohttp.ClientSession() as http:
        callback, cookie = await log_in(client, http, "alice")
        with pytest.raises(expected, match=match):
            await client.finish(http, callback, cookie)


async def test_auth_methods_of_another_shape_read_as_the_default(provider: Provider) -> None:
    doc = _discovery(provider) | {"token_endpoint_auth_methods_supported": 5}
    provider.answers["/.well-known/openid-configuration"] = (200, json.dumps(doc).encode())
    client = OidcClient(config(provider))
    async with aiohttp.ClientSession() as http:
        callback, cookie = await log_in(client, http, "alice")
        assert (await client.finish(http, callback, cookie))["sub"] == "sub-alice"


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:99999/token", "http://x\r\nSet-Cookie: a=b", "https://", "javascript:x", "/token", 5]
)
async def test_a_discovery_document_naming_an_endpoint_that_is_no_url_is_a_502(provider: Provider, url: object) -> None:
    doc = _discovery(provider) | {"token_endpoint": url}
    provider.answers["/.well-known/openid-configuration"] = (200, json.dumps(doc).encode())
    client = OidcClient(config(provider))
    async with aiohttp.ClientSession() as http:
        with pytest.raises(OidcProviderFailed):
            await client.begin(http, REDIRECT)


async def test_a_jwks_with_keys_of_other_kinds_still_verifies_with_its_signing_key(provider: Provider) -> None:
    odd = [{"kty": "EC", "crv": "P-999", "x": "a", "y": "b"}, {"kty": "XYZ"}, {"kty": "oct", "k": "c2VjcmV0"}, 7,
           {"kty": "OKP", "crv": "Ed25519", "x": "AAAA"},
           {"kty": "RSA", "kid": "big", "n": "A" * 200_000, "e": "AQAB"}]  # fmt: skip
    keys = {"keys": [*odd, provider.key.as_dict(private=False)]}
    provider.answers["/jwks"] = (200, json.dumps(keys).encode())
    client = OidcClient(config(provider))
    async with aiohttp.ClientSession() as http:
        callback, cookie = await log_in(client, http, "alice")
        assert (await client.finish(http, callback, cookie))["sub"] == "sub-alice"
    provider.answers["/jwks"] = (200, json.dumps({"keys": odd}).encode())
    await _login_fails(provider, OidcProviderFailed, "no signing key")


@pytest.mark.parametrize(
    "claims, why",
    [
        ({"exp": float("inf")}, "exp"),
        ({"exp": "9999999999"}, "exp"),
        ({"iat": True}, "iat"),
        ({"sub": 5}, "sub"),
        ({"nonce": ["x"]}, "nonce"),
        ({"aud": {"aud": CLIENT_ID}}, "aud"),
        ({"aud": [5]}, "aud"),
    ],
)
async def test_a_signed_claim_of_the_wrong_type_is_refused(
    provider: Provider, claims: dict[str, Any], why: str
) -> None:
    provider.claims = claims
    await _login_fails(provider, OidcRefused, why)


@pytest.mark.parametrize(
    "make",
    [
        lambda c: _b64(b'{"alg":"none"}') + "." + _b64(json.dumps(c).encode()) + ".",
        lambda c: _b64(b'{"alg":"RS256","kid":5}') + "." + _b64(json.dumps(c).encode()) + "." + _b64(b"s"),
        lambda c: _b64(b"[1]") + "." + _b64(b"{}") + "." + _b64(b"s"),
        lambda c: "a.b",
    ],
    ids=["alg-none", "kid-int", "header-list", "two-parts"],
)
async def test_a_token_that_is_no_signed_jwt_is_refused(provider: Provider, make: Any) -> None:
    provider.make_token = make
    await _login_fails(provider, OidcRefused, "ID token")


async def test_a_token_nested_past_the_parsers_depth_is_refused(provider: Provider) -> None:
    from joserfc import jws

    provider.make_token = lambda _: jws.serialize_compact(
        {"alg": "RS256", "kid": "test-1"}, b"[" * 5000 + b"]" * 5000, provider.key
    )
    await _login_fails(provider, OidcRefused, "signature does not verify|claims")


async def test_callback_parameters_that_are_not_visible_ascii_are_a_400(provider: Provider) -> None:
    client = OidcClient(config(provider))
    async with aiohttp.ClientSession() as http:
        callback, cookie = await log_in(client, http, "alice")
        with pytest.raises(OidcBadRequest):  # a lone surrogate: what aiohttp makes of %FF in a query
            await client.finish(http, {**callback, "code": "\udcff\udcfe"}, cookie)
        callback, cookie = await log_in(client, http, "alice")
        with pytest.raises(OidcRefused) as refused:
            await client.finish(http, {**callback, "error": "denied\udcff"}, cookie)
    error_response(refused.value)  # the answer can be written (it once failed to encode: a 500)
    assert "\udcff" not in refused.value.message


def _discovery(provider: Provider) -> dict[str, Any]:
    return discovery_document(provider.issuer, auth_methods=("client_secret_basic",))

"""Console logins: the token or single sign-on that opens a session, the session cookie and its CSRF
token, and the backoff that makes guessing a token cost time.

## Sessions (`ConsoleSessions`)

Console logins: the admin token (or a user's token, or an OIDC login) is exchanged once for a
session cookie (HttpOnly, SameSite=Strict, Path=/), so the token never sits in the page, its storage
or a URL, and a page script cannot read the cookie. The session keeps who logged in: its role bounds
every call made with the cookie (gateway/http/access.py).

Each session also has its own CSRF token, random and bound to it: the console's script receives it
from the login answer (or `GET /ui/session`, which only a same-origin page can read) and sends it in
`X-Tokenway-CSRF` with every change; `gateway/http/access.py` compares it in constant time. A page of
another origin gets the cookie attached by the browser but can neither read nor guess the token.

Sessions are random 256-bit ids held in memory by their SHA-256 (a lookup leaks no timing about the
id itself) with an expiry (a restart logs everyone out); the table is bounded, oldest dropped first.

## Failed logins (`LoginThrottle`)

Backoff for failed console logins, per client address and across all clients.

A login is the one operator surface that takes a secret from anyone who can reach it, so guessing
must cost time: after `free_failures` wrong tokens within `window_s`, a client waits
`base_delay_s * 2^(failures - free_failures)` (capped at `max_delay_s`) before its next try is even
looked at, and is answered 429 with `Retry-After` meanwhile. The same backoff runs over all clients
together (a guesser spreading over many addresses), with a larger allowance and a shorter cap, so a
flood slows every guesser without locking the operator out for long. A success clears that
client's record (never the global one).

Memory is bounded: at most `max_clients` addresses are remembered, the least recently failing
dropped first (an attacker evicting its own records still meets the global backoff).

## Single sign-on (`OidcClient`)

Console single sign-on: OpenID Connect's authorization code flow with PKCE (`server.oidc`).

`GET /ui/oidc/login` reads the provider's discovery document, keeps a pending login (state, nonce,
PKCE verifier) and sends the browser to the provider; `GET /ui/oidc/callback` takes the code back,
exchanges it with the verifier, checks the ID token (signature against the provider's JWKS, issuer,
audience, expiry, nonce) and opens an ordinary console session for the identity the token maps to
(gateway/http/access.py). What is checked, and why:

- `state` ties the callback to a login this gateway started, and a short-lived HttpOnly cookie ties it
  to the browser that started it: a callback URL an attacker makes a victim open (login CSRF, which
  would sign the victim into the attacker's account) has no such cookie and is refused.
- PKCE (S256) makes a code intercepted on its way back useless without the verifier, which never
  leaves the gateway; the `nonce` in the ID token ties the token to this login (no replay).
- The ID token is verified although it came straight from the token endpoint over TLS: the keys are
  the provider's published JWKS (fetched again when a token names a key not yet seen, as after a
  rotation); only asymmetric algorithms of `server.oidc.algorithms` are accepted, never `none` or an
  HMAC keyed by a public value.
- Roles come from the configuration, never from the provider alone: a verified `email` naming one of
  `server.users` becomes that user; otherwise the values of the groups claim are looked up in
  `server.oidc.group_roles`; a login that maps to nothing is refused.

What the provider answers is input, read through one validating step each: the discovery document
(`_endpoint_url`), the JWKS (`_usable_key`, each key imported on its own: one odd key never spoils the
set), the ID token's header (`_token_header`, before any key is looked up) and its claims
(`_claims_of_wrong_type`, before joserfc's checks); the callback's `state` and `code` are the browser's
and must be visible ASCII. Any failure is a GatewayError (400, 403, or 502 for the provider), never
an exception a handler did not expect, and text from outside reaches a message only through
`printable` (a lone surrogate would fail the JSON answer).

Pending logins are held in memory (a restart forgets them: the user clicks again), bounded in number
and age. Calls to the provider are aiohttp calls with a timeout and bounded answers, never blocking
the event loop. authlib makes the PKCE challenge and the random values; joserfc (the JOSE library
authlib builds on) verifies the token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web

from gateway.app.settings import OidcConfig
from gateway.errors import GatewayError
from gateway.http.access import CONSOLE, CSRF_HEADER, Identity, Users

if TYPE_CHECKING:
    from joserfc.jwk import KeySet

# authlib and joserfc (with `cryptography` under them) are imported by the OIDC client's methods, not
# here: every gateway imports this module, and they cost a start-up about a tenth of its imports'
# CPU where no single sign-on is configured, the default.

__all__ = ["COOKIE", "CSRF_HEADER", "ConsoleSessions"]

COOKIE = "tokenway_console"
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 256


@dataclass(frozen=True, slots=True)
class _Session:
    expires_at: float
    csrf: str
    identity: Identity  # who logged in (its role bounds every call the session makes: gateway/http/access.py)


class ConsoleSessions:
    def __init__(self, *, ttl_s: float = SESSION_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    def open(self, identity: Identity = CONSOLE) -> tuple[str, str]:
        """A new session of `identity`: (its cookie value, its CSRF token)."""
        session, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        self._sessions[_digest(session)] = _Session(self._clock() + self.ttl_s, csrf, identity)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session, csrf

    def csrf_of(self, session: str | None) -> str | None:
        """The CSRF token of a live session, None for no cookie or an unknown or expired one."""
        found = self.session_of(session)
        return found[0] if found is not None else None

    def session_of(self, session: str | None) -> tuple[str, Identity] | None:
        """The CSRF token and identity of a live session, None for no cookie or an unknown or expired one."""
        if not session:
            return None
        key = _digest(session)
        found = self._sessions.get(key)
        if found is None:
            return None
        if found.expires_at <= self._clock():
            del self._sessions[key]
            return None
        return found.csrf, found.identity

    def valid(self, session: str | None) -> bool:
        return self.csrf_of(session) is not None

    def close(self, session: str | None) -> None:
        if session:
            self._sessions.pop(_digest(session), None)


def _digest(session: str) -> str:
    return hashlib.sha256(session.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(slots=True)
class _Record:
    failures: int
    last_failure: float
    blocked_until: float


@dataclass(frozen=True, slots=True)
class Backoff:
    free_failures: int
    base_delay_s: float
    max_delay_s: float
    window_s: float

    def delay_s(self, failures: int) -> float:
        if failures < self.free_failures:
            return 0.0
        return min(self.max_delay_s, self.base_delay_s * 2.0 ** min(failures - self.free_failures, 64))


PER_CLIENT = Backoff(free_failures=5, base_delay_s=1.0, max_delay_s=900.0, window_s=900.0)
GLOBAL = Backoff(free_failures=50, base_delay_s=0.5, max_delay_s=30.0, window_s=300.0)
MAX_CLIENTS = 4096


class LoginThrottle:
    def __init__(
        self,
        *,
        per_client: Backoff = PER_CLIENT,
        overall: Backoff = GLOBAL,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_client = per_client
        self.overall = overall
        self.max_clients = max_clients
        self._clock = clock
        self._clients: OrderedDict[str, _Record] = OrderedDict()
        self._global = _Record(0, 0.0, 0.0)

    def retry_after_s(self, client: str) -> float:
        """Seconds before `client` may try again (0: now)."""
        now = self._clock()
        record = self._clients.get(client)
        waits = [self._global.blocked_until - now]
        if record is not None:
            waits.append(record.blocked_until - now)
        return max(0.0, *waits)

    def failed(self, client: str) -> tuple[int, float]:
        """Count a wrong token; returns the client's failures in its window and its wait before the next try."""
        now = self._clock()
        record = self._clients.pop(client, None)
        if record is None or now - record.last_failure > self.per_client.window_s:
            record = _Record(0, now, 0.0)
        record.failures += 1
        record.last_failure = now
        record.blocked_until = now + self.per_client.delay_s(record.failures)
        self._clients[client] = record  # most recent last
        while len(self._clients) > self.max_clients:
            self._clients.popitem(last=False)
        glob = self._global
        if now - glob.last_failure > self.overall.window_s:
            glob.failures = 0
        glob.failures += 1
        glob.last_failure = now
        glob.blocked_until = now + self.overall.delay_s(glob.failures)
        return record.failures, max(record.blocked_until, glob.blocked_until) - now

    def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)

    def __len__(self) -> int:
        return len(self._clients)


def retry_after_header(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))


log = logging.getLogger("tokenway.audit")

CALLBACK_PATH = "/ui/oidc/callback"
FLOW_COOKIE = "tokenway_oidc"
PENDING_TTL_S = 600.0
MAX_PENDING = 1024
DISCOVERY_TTL_S = 3600.0
MAX_ANSWER_BYTES = 512 * 1024
MAX_GROUPS = 1000
MAX_ACTOR_CHARS = 200
MAX_URL_CHARS = 2048  # an endpoint of the discovery document
MAX_PARAM_CHARS = 2048  # the callback's `code` (RFC 6749: visible ASCII) and `state`
MAX_TOKEN_CHARS = 64 * 1024  # the ID token: far beyond any provider's, within MAX_ANSWER_BYTES
MAX_KEYS = 100  # keys of a JWKS looked at; the rest are ignored
MAX_RSA_BITS = 8192  # a larger modulus is refused (verifying with a huge one costs the event loop seconds)
_KEY_TYPES = ("RSA", "EC", "OKP")  # the asymmetric keys of `server.oidc.algorithms`; "oct" never
_CLAIM_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError, OverflowError)
_RANK = {"viewer": 1, "team_admin": 2, "admin": 3}


class OidcRefused(GatewayError):
    """The login cannot be completed: a callback this gateway did not start, or a token that fails."""

    status = 403
    type = "permission_error"
    code = "oidc_login_refused"


class OidcBadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "oidc_bad_callback"


class OidcNotConfigured(GatewayError):
    status = 404
    type = "not_found_error"
    code = "oidc_not_configured"


class OidcProviderFailed(GatewayError):
    """The provider did not answer as OpenID Connect says (down, slow, or a malformed document)."""

    status = 502
    type = "server_error"
    code = "oidc_provider_failed"


@dataclass(frozen=True, slots=True)
class _Pending:
    verifier: str
    nonce: str
    redirect_uri: str
    browser: str  # SHA-256 of the flow cookie the browser got
    expires_at: float


@dataclass(frozen=True, slots=True)
class _Provider:
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    basic_auth: bool  # client_secret_basic (the default) rather than client_secret_post
    fetched_at: float


class OidcClient:
    """One gateway's relying party: its pending logins, the provider's document and keys."""

    def __init__(self, config: OidcConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._provider: _Provider | None = None
        self._keys: KeySet | None = None

    # ------------------------------------------------------------------ the two steps
    async def begin(self, http: aiohttp.ClientSession, redirect_uri: str) -> tuple[str, str]:
        """The provider's authorization URL for a new login, and the flow cookie for this browser."""
        from authlib.common.security import generate_token
        from authlib.common.urls import add_params_to_uri
        from authlib.oauth2.rfc7636 import create_s256_code_challenge

        provider = await self._discover(http)
        state, nonce, verifier, cookie = generate_token(43), generate_token(43), generate_token(64), generate_token(43)
        now = self._clock()
        self._drop_expired(now)
        self._pending[state] = _Pending(verifier, nonce, redirect_uri, _digest(cookie), now + PENDING_TTL_S)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        url = add_params_to_uri(
            provider.authorization_endpoint,
            [
                ("response_type", "code"),
                ("client_id", self.config.client_id),
                ("redirect_uri", redirect_uri),
                ("scope", " ".join(self.config.scopes)),
                ("state", state),
                ("nonce", nonce),
                ("code_challenge", create_s256_code_challenge(verifier)),
                ("code_challenge_method", "S256"),
            ],
        )
        return url, cookie

    async def finish(self, http: aiohttp.ClientSession, query: Mapping[str, str], cookie: str | None) -> dict[str, Any]:
        """The verified ID token's claims of the login `query` (the callback's) completes. The query and
        the cookie are the browser's, so read as any client input: `state` and `code` are visible
        ASCII (RFC 6749's VSCHAR) or refused before anything is looked up or sent."""
        state = query.get("state", "")
        if not _vschar(state):
            raise OidcBadRequest("the callback's state is not one this gateway makes")
        pending = self._pending.pop(state, None) if state else None
        if pending is None or pending.expires_at <= self._clock():
            raise OidcRefused("this sign-on was not started here, was already used, or is too old: start again")
        if not cookie or not hmac.compare_digest(_digest(cookie), pending.browser):
            raise OidcRefused("this sign-on was started in another browser: start again")
        if "error" in query:
            raise OidcRefused(f"the provider refused the sign-on: {printable(query.get('error', ''), 100)}")
        code = query.get("code")
        if not code:
            raise OidcBadRequest("the callback carries no code")
        if not _vschar(code):
            raise OidcBadRequest("the callback's code is not visible ASCII of at most 2,048 characters")
        provider = await self._discover(http)
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": pending.redirect_uri,
            "code_verifier": pending.verifier,
        }
        headers: dict[str, str] = {}
        if self.config.client_secret and provider.basic_auth:  # RFC 6749 2.3.1: each part form-encoded
            pair = f"{quote(self.config.client_id, safe='')}:{quote(self.config.client_secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
        else:
            form["client_id"] = self.config.client_id
            if self.config.client_secret:
                form["client_secret"] = self.config.client_secret
        status, answer = await self._call(http, "POST", provider.token_endpoint, data=form, headers=headers)
        token = answer.get("id_token")
        if status != 200 or not isinstance(token, str) or not token:
            raise OidcRefused(f"the provider did not exchange the code ({printable(answer.get('error', status), 100)})")
        return await self._verified(http, provider, token, pending.nonce)

    # ------------------------------------------------------------------ the ID token
    async def _verified(
        self, http: aiohttp.ClientSession, provider: _Provider, token: str, nonce: str
    ) -> dict[str, Any]:
        from joserfc import jwt
        from joserfc.errors import JoseError

        algorithms = list(self.config.algorithms)
        kid = _token_header(token, algorithms)
        keys = await self._key_set(http, provider)
        if kid is not None and not any(k.kid == kid for k in keys.keys):
            # a key the cached set lacks (the provider rotated): fetch the set once more
            keys = await self._key_set(http, provider, fresh=True)
        try:
            decoded = jwt.decode(token, keys, algorithms=algorithms)
        except (JoseError, *_CLAIM_ERRORS) as exc:
            raise OidcRefused(f"the ID token's signature does not verify ({type(exc).__name__})") from None
        claims = decoded.claims
        if not isinstance(claims, dict):
            raise OidcRefused("the ID token's claims are not an object")
        wrong = _claims_of_wrong_type(claims)
        if wrong:
            raise OidcRefused(f"the ID token's claim {wrong} is not of its type")
        registry = jwt.JWTClaimsRegistry(
            leeway=int(self.config.leeway_s),
            iss={"essential": True, "value": self.config.issuer},
            aud={"essential": True, "value": self.config.client_id},
            sub={"essential": True},
            exp={"essential": True},
            iat={"essential": True},
            nonce={"essential": True, "value": nonce},
        )
        try:
            registry.validate(claims)
        except JoseError as exc:
            why = f"{exc.error}: {printable(exc.description, 200)}"
            raise OidcRefused(f"the ID token is not for this login ({why})") from None
        except _CLAIM_ERRORS as exc:
            raise OidcRefused(f"the ID token's claims cannot be read ({type(exc).__name__})") from None
        audiences = claims["aud"] if isinstance(claims["aud"], list) else [claims["aud"]]
        if len(audiences) > 1 and claims.get("azp") != self.config.client_id:  # OIDC Core 3.1.3.7, 4-5
            raise OidcRefused("the ID token names several audiences and another authorized party")
        return claims

    async def _key_set(self, http: aiohttp.ClientSession, provider: _Provider, *, fresh: bool = False) -> KeySet:
        """The provider's signing keys: each entry of its JWKS read on its own (at most MAX_KEYS), the
        ones of another kind (symmetric, encryption, unknown, malformed, an RSA modulus past
        MAX_RSA_BITS) skipped; a set with none left is the provider's failure (502)."""
        from joserfc.errors import JoseError
        from joserfc.jwk import KeySet

        if self._keys is None or fresh:
            status, doc = await self._call(http, "GET", provider.jwks_uri)
            found = doc.get("keys")
            if status != 200 or not isinstance(found, list):
                raise OidcProviderFailed(f"the provider's JWKS cannot be read (status {status}, no list of keys)")
            keys = []
            for entry in found[:MAX_KEYS]:  # a key of a kind not used here is skipped, not fatal to the set
                if not _usable_key(entry):
                    continue
                try:
                    keys.append(KeySet.import_key_set({"keys": [entry]}).keys[0])
                except (JoseError, *_CLAIM_ERRORS):
                    continue
            if not keys:
                raise OidcProviderFailed("the provider's JWKS holds no signing key this gateway can use")
            self._keys = KeySet(keys)
        return self._keys

    # ------------------------------------------------------------------ the provider
    async def _discover(self, http: aiohttp.ClientSession) -> _Provider:
        now = self._clock()
        if self._provider is not None and now - self._provider.fetched_at < DISCOVERY_TTL_S:
            return self._provider
        url = self.config.issuer + "/.well-known/openid-configuration"
        status, doc = await self._call(http, "GET", url)
        endpoints = [_endpoint_url(doc.get(k)) for k in ("authorization_endpoint", "token_endpoint", "jwks_uri")]
        if status != 200 or not all(endpoints):
            raise OidcProviderFailed(f"{url} is not an OpenID Connect discovery document (status {status})")
        if doc.get("issuer") != self.config.issuer:  # OIDC Discovery 4.3: must be exactly the issuer asked
            named = printable(doc.get("issuer"), 200)
            raise OidcProviderFailed(f"{url} names issuer {named!r}, not the one configured")
        methods = doc.get("token_endpoint_auth_methods_supported")
        if not isinstance(methods, list) or not methods:  # absent (or not a list): the specification's default
            methods = ["client_secret_basic"]
        basic = "client_secret_basic" in methods or "client_secret_post" not in methods
        self._provider = _Provider(str(endpoints[0]), str(endpoints[1]), str(endpoints[2]), basic, now)
        self._keys = None
        return self._provider

    async def _call(
        self, http: aiohttp.ClientSession, method: str, url: str, **kwargs: Any
    ) -> tuple[int, dict[str, Any]]:
        """A JSON answer of the provider, bounded in size and time; its status kept for the caller."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
            async with http.request(method, url, timeout=timeout, allow_redirects=False, **kwargs) as response:
                body = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    body += chunk
                    if len(body) > MAX_ANSWER_BYTES:
                        raise OidcProviderFailed(f"{url} answered more than {MAX_ANSWER_BYTES} bytes")
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: a URL aiohttp cannot use
            raise OidcProviderFailed(f"the provider did not answer {method} {url}: {type(exc).__name__}") from None
        try:
            doc = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            raise OidcProviderFailed(f"{url} did not answer JSON (status {status})") from None
        return status, doc if isinstance(doc, dict) else {}

    def _drop_expired(self, now: float) -> None:
        while self._pending:
            state, first = next(iter(self._pending.items()))
            if first.expires_at > now:
                return
            del self._pending[state]


def printable(value: object, limit: int) -> str:
    """`value` as text fit for an error message or a log line: visible characters only (a lone
    surrogate from a percent-escape that is not UTF-8 would fail the JSON answer), at most `limit`."""
    return "".join(c if c.isprintable() else "?" for c in str(value)[:limit])


def _vschar(value: str) -> bool:
    return len(value) <= MAX_PARAM_CHARS and all("\x20" <= c <= "\x7e" for c in value)


def _endpoint_url(value: object) -> str | None:
    """An endpoint of the discovery document when it is an absolute http(s) URL aiohttp can call and
    a browser can be sent to (visible ASCII: no header can be split by it), else None."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_URL_CHARS or not _vschar(value) or " " in value:
        return None
    from yarl import URL

    try:
        url = URL(value)
        port = url.port
    except (ValueError, TypeError):
        return None
    if url.scheme not in ("https", "http") or not url.host or port is None or not 0 < port < 65536:
        return None
    return value


def _token_header(token: str, algorithms: Sequence[str]) -> str | None:
    """The `kid` of an ID token whose protected header is one this gateway verifies: three parts,
    a JSON object naming one of `algorithms` (never `none`, never HMAC), `kid` a string if present,
    no `crit` extension. Anything else is refused here, before a key is looked up."""
    parts = token.split(".")
    if len(token) > MAX_TOKEN_CHARS or len(parts) != 3 or not all(parts):
        raise OidcRefused("the ID token is not a signed JWT (three parts)")
    try:
        header = orjson.loads(base64.urlsafe_b64decode(parts[0] + "=" * (-len(parts[0]) % 4)))
    except (ValueError, orjson.JSONDecodeError):
        raise OidcRefused("the ID token's header is not JSON") from None
    if not isinstance(header, dict) or header.get("alg") not in algorithms:
        raise OidcRefused(f"the ID token is not signed with one of {', '.join(algorithms)}")
    kid = header.get("kid")
    if (kid is not None and not isinstance(kid, str)) or "crit" in header:
        raise OidcRefused("the ID token's header names a key that is not a string, or an extension")
    return kid


def _usable_key(entry: object) -> bool:
    """A JWKS entry worth importing: an object of an asymmetric key type, for signatures (or of no
    stated use), with an RSA modulus of at most MAX_RSA_BITS."""
    if not isinstance(entry, dict) or entry.get("kty") not in _KEY_TYPES or entry.get("use", "sig") != "sig":
        return False
    kid, modulus = entry.get("kid"), entry.get("n")
    if kid is not None and not isinstance(kid, str):
        return False
    return not isinstance(modulus, str) or len(modulus) * 6 <= MAX_RSA_BITS + 8


_NUMBER_CLAIMS = ("exp", "iat", "nbf", "auth_time")
_TEXT_CLAIMS = ("iss", "sub", "nonce", "azp")


def _claims_of_wrong_type(claims: Mapping[str, Any]) -> str | None:
    """The first registered claim whose value is not of the type OpenID Connect gives it (a time is
    a finite number, not a boolean; `aud` a string or a list of them; the others strings), else None."""
    for name in _NUMBER_CLAIMS:
        value = claims.get(name)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
            return name
    for name in _TEXT_CLAIMS:
        if name in claims and not isinstance(claims[name], str):
            return name
    aud = claims.get("aud")
    listed = isinstance(aud, list) and bool(aud) and all(isinstance(a, str) for a in aud)
    return "aud" if aud is not None and not isinstance(aud, str) and not listed else None


def identity_of_claims(claims: Mapping[str, Any], config: OidcConfig, users: Users) -> Identity | None:
    """The identity a verified login maps to (None: it maps to no role). A user of `server.users`
    named by a verified email first; else the highest role of the user's groups in `group_roles`
    (a team admin of several groups manages all their teams)."""
    email = claims.get("email")
    verified = claims.get("email_verified") in (True, "true")
    if isinstance(email, str) and (verified or config.trust_unverified_email):
        user = users.by_email.get(email.strip().lower())
        if user is not None:
            return user
    found = claims.get(config.groups_claim)
    groups = [found] if isinstance(found, str) else found if isinstance(found, list) else []
    grants = [config.group_roles[g] for g in groups[:MAX_GROUPS] if isinstance(g, str) and g in config.group_roles]
    if not grants:
        return None
    role = max((g.role for g in grants), key=_RANK.__getitem__)
    teams = (
        frozenset(t for g in grants if g.role == "team_admin" for t in g.teams) if role == "team_admin" else frozenset()
    )
    who = email if isinstance(email, str) and email else str(claims.get("sub", "?"))
    actor = "oidc:" + "".join(c for c in who if c.isprintable())[:MAX_ACTOR_CHARS]
    return Identity(actor, role, teams)


def redirect_uri_of(request: web.Request, config: OidcConfig) -> str:
    """Where the provider sends the browser back: the configured URL, else this request's origin."""
    if config.redirect_url is not None:
        return config.redirect_url
    return f"{request.scheme}://{request.host}{CALLBACK_PATH}"

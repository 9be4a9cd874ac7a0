"""A small OpenID Connect provider for the tests of the console's single sign-on: a real HTTP server on a
free loopback port, in a thread of the test process, with an RSA key generated when it starts (nothing
downloaded, nothing shared between runs).

It serves what a relying party of the authorization code flow reads: the discovery document, the
JWKS, an authorization page (a form naming the user, which Chromium fills in: a real login), and the
token endpoint, which checks the client's credentials, the redirect URI and the PKCE verifier (S256,
computed here with hashlib, independently of the gateway's authlib) before it signs an ID token
(joserfc). `tamper` makes it answer wrongly on purpose (another signing key, another audience, a
stale or foreign nonce, an expired token) so the gateway's refusals can be tested.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from joserfc import jwt
from joserfc.jwk import RSAKey


@dataclass
class _Grant:
    user: str
    client_id: str
    redirect_uri: str
    challenge: str
    nonce: str


@dataclass
class Provider:
    """The provider's state; `issuer` is its base URL once started."""

    client_id: str
    client_secret: str | None
    users: dict[str, dict[str, Any]]  # login name -> extra claims (email, email_verified, groups, ...)
    redirect_uris: list[str] = field(default_factory=list)
    issuer: str = ""
    tamper: str | None = None  # "key", "audience", "nonce", "expired", "issuer"
    key: RSAKey = field(default_factory=lambda: RSAKey.generate_key(2048, parameters={"kid": "test-1"}))
    other_key: RSAKey = field(default_factory=lambda: RSAKey.generate_key(2048, parameters={"kid": "test-1"}))
    grants: dict[str, _Grant] = field(default_factory=dict)
    token_requests: list[dict[str, str]] = field(default_factory=list)

    def id_token(self, grant: _Grant) -> str:
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.issuer if self.tamper != "issuer" else self.issuer + "/other",
            "sub": f"sub-{grant.user}",
            "aud": grant.client_id if self.tamper != "audience" else "another-client",
            "iat": now,
            "exp": now + 300 if self.tamper != "expired" else now - 3600,
            "nonce": grant.nonce if self.tamper != "nonce" else "a-nonce-of-another-login",
            **self.users[grant.user],
        }
        key = self.key if self.tamper != "key" else self.other_key
        return jwt.encode({"alg": "RS256", "kid": "test-1"}, claims, key)


def _s256(verifier: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode("ascii")).digest()).rstrip(b"=").decode()


def _handler(provider: Provider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, doc: Any) -> None:
            self._send(status, json.dumps(doc).encode(), "application/json")

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            if parts.path == "/.well-known/openid-configuration":
                self._json(
                    200,
                    {
                        "issuer": provider.issuer,
                        "authorization_endpoint": provider.issuer + "/authorize",
                        "token_endpoint": provider.issuer + "/token",
                        "jwks_uri": provider.issuer + "/jwks",
                        "response_types_supported": ["code"],
                        "subject_types_supported": ["public"],
                        "id_token_signing_alg_values_supported": ["RS256"],
                        "code_challenge_methods_supported": ["S256"],
                        "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
                    },
                )
            elif parts.path == "/jwks":
                self._json(200, {"keys": [provider.key.as_dict(private=False)]})
            elif parts.path == "/authorize":
                self._authorize_page(query)
            else:
                self._json(404, {"error": "not_found"})

        def _authorize_page(self, query: dict[str, str]) -> None:
            if (
                query.get("response_type") != "code"
                or query.get("client_id") != provider.client_id
                or query.get("redirect_uri") not in provider.redirect_uris
                or query.get("code_challenge_method") != "S256"
                or not query.get("code_challenge")
                or "openid" not in query.get("scope", "").split()
            ):
                self._json(400, {"error": "invalid_request", "got": query})
                return
            hidden = "".join(
                f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">' for k, v in query.items()
            )
            page = (
                "<!doctype html><title>Test provider</title><form method=post action=/authorize>"
                f'{hidden}<label>User <input id="username" name="username"></label>'
                '<button id="approve" type="submit">Sign in</button></form>'
            )
            self._send(200, page.encode(), "text/html")

        def _form(self) -> dict[str, str]:
            length = int(self.headers.get("Content-Length", "0"))
            return {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}

        def do_POST(self) -> None:
            path = urlsplit(self.path).path
            form = self._form()
            if path == "/authorize":
                user = form.get("username", "")
                if user not in provider.users:
                    self._send(403, b"unknown user", "text/plain")
                    return
                code = secrets.token_urlsafe(24)
                provider.grants[code] = _Grant(
                    user, form["client_id"], form["redirect_uri"], form["code_challenge"], form.get("nonce", "")
                )
                target = form["redirect_uri"] + "?" + urlencode({"code": code, "state": form.get("state", "")})
                self._send(302, b"", "text/plain", {"Location": target})
            elif path == "/token":
                self._token(form)
            else:
                self._json(404, {"error": "not_found"})

        def _token(self, form: dict[str, str]) -> None:
            provider.token_requests.append(form)
            client_id, secret = form.get("client_id"), form.get("client_secret")
            auth = self.headers.get("Authorization", "")
            if auth.startswith("Basic "):
                client_id, _, secret = base64.b64decode(auth[6:]).decode().partition(":")
            if client_id != provider.client_id or (provider.client_secret and secret != provider.client_secret):
                self._json(401, {"error": "invalid_client"})
                return
            grant = provider.grants.pop(form.get("code", ""), None)  # a code is good once
            if grant is None or form.get("grant_type") != "authorization_code":
                self._json(400, {"error": "invalid_grant"})
                return
            if form.get("redirect_uri") != grant.redirect_uri or client_id != grant.client_id:
                self._json(400, {"error": "invalid_grant", "error_description": "redirect_uri or client"})
                return
            if _s256(form.get("code_verifier", "")) != grant.challenge:
                self._json(400, {"error": "invalid_grant", "error_description": "PKCE verifier"})
                return
            self._json(
                200,
                {
                    "access_token": secrets.token_urlsafe(16),
                    "token_type": "Bearer",
                    "id_token": provider.id_token(grant),
                },
            )

    return Handler


@contextmanager
def oidc_provider(client_id: str, client_secret: str | None, users: dict[str, dict[str, Any]]) -> Iterator[Provider]:
    """A running provider on 127.0.0.1 (a free port chosen by the kernel), stopped on exit."""
    provider = Provider(client_id, client_secret, users)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(provider))
    provider.issuer = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="oidc-provider", daemon=True)
    thread.start()
    try:
        yield provider
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

"""Console logins: the admin token (or a user's token, or an OIDC login) is exchanged once for a
session cookie (HttpOnly, SameSite=Strict, Path=/), so the token never sits in the page, its storage
or a URL, and a page script cannot read the cookie. The session keeps who logged in: its role bounds
every call made with the cookie (gateway/http/roles.py).

Each session also has its own CSRF token, random and bound to it: the console's script receives it
from the login answer (or `GET /ui/session`, which only a same-origin page can read) and sends it in
`X-Tokenway-CSRF` with every change; `gateway/http/access.py` compares it in constant time. A page of
another origin gets the cookie attached by the browser but can neither read nor guess the token.

Sessions are random 256-bit ids held in memory by their SHA-256 (a lookup leaks no timing about the
id itself) with an expiry (a restart logs everyone out); the table is bounded, oldest dropped first.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.http.access import CSRF_HEADER
from gateway.http.roles import CONSOLE, Identity

__all__ = ["COOKIE", "CSRF_HEADER", "ConsoleSessions"]

COOKIE = "tokenway_console"
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 256


@dataclass(frozen=True, slots=True)
class _Session:
    expires_at: float
    csrf: str
    identity: Identity  # who logged in (its role bounds every call the session makes: gateway/http/roles.py)


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

"""Console logins: the admin token is exchanged once for a session cookie (HttpOnly, SameSite=Strict),
so the token never sits in the page, its storage or a URL, and a page script cannot read the cookie.

Sessions are random 256-bit ids held in memory with an expiry (a restart logs everyone out); the
table is bounded, oldest dropped first. With cookie authentication, requests that change something
must also carry `X-Tokenway-Console: 1`: a header no cross-site form can send, on top of SameSite.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

COOKIE = "tokenway_console"
CSRF_HEADER = "X-Tokenway-Console"
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 256


class ConsoleSessions:
    def __init__(self, *, ttl_s: float = SESSION_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, float] = OrderedDict()

    def open(self) -> str:
        session = secrets.token_urlsafe(32)
        self._sessions[session] = self._clock() + self.ttl_s
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session

    def valid(self, session: str | None) -> bool:
        if not session:
            return False
        for known, expires_at in list(self._sessions.items()):
            if expires_at <= self._clock():
                del self._sessions[known]
            elif hmac.compare_digest(known, session):
                return True
        return False

    def close(self, session: str | None) -> None:
        if session:
            self._sessions.pop(session, None)

"""Session affinity table: session key -> the endpoint that served the session last (bounded LRU).

Keys come from the client (`x-session-id`, the body's `user`), so the table is bounded in entries
(`max_sessions`) and in bytes per entry: a key longer than MAX_SESSION_KEY_CHARS is kept as a 128-bit
hash of its bytes (the same session still maps to the same pin).
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from policies.types import RequestFacts

MAX_SESSION_KEY_CHARS = 64


def bounded_key(key: str) -> str:
    """`key` itself when short and valid text, else '#' + its 128-bit hash (32 hex characters)."""
    if len(key) <= MAX_SESSION_KEY_CHARS:
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            pass
        else:
            return key
    return "#" + xxhash.xxh3_128_hexdigest(key.encode("utf-8", "surrogateescape"))


def session_key(facts: RequestFacts, pool: str, use_user_field: bool) -> str | None:
    """The request's session in one pool: `RequestFacts.session_key` (a header), else the OpenAI
    `user` field. Keyed per pool so a session that falls back to another model keeps both pins."""
    key = facts.session_key
    if key is None and use_user_field:
        user = facts.body.get("user")
        if isinstance(user, str) and user:
            key = user
    return f"{pool}\x00{bounded_key(key)}" if key else None


class SessionTable:
    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._pins: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def key_chars(self) -> int:
        """Characters held by the session keys (each a bounded `session_key`): memory, not count."""
        return sum(map(len, self._pins))

    def get(self, key: str | None) -> str | None:
        return self._pins.get(key) if key is not None else None

    def pin(self, key: str | None, endpoint_id: str) -> None:
        if key is None:
            return
        pins = self._pins
        if key in pins:
            pins.move_to_end(key)
        pins[key] = endpoint_id
        while len(pins) > self.max_sessions:
            pins.popitem(last=False)

"""What the gateway takes from a client's headers, made safe to use and to keep.

Header values reach aiohttp as bytes and come out as `str` with undecodable bytes kept as lone
surrogates, which fail the moment anything encodes them (a digest, a log line, a ledger record, a
forwarded header). Everything read here is either checked (an API key with such bytes is simply not
a key: 401) or replaced (a request id that is not short visible ASCII gets a generated one). Session
keys are bounded where they are kept (`policies/routing/session.py`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")


def encodable(value: str) -> bool:
    """True when `value` is valid text (no undecodable bytes smuggled in as surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def request_id(headers: Mapping[str, str]) -> str:
    """The client's `x-request-id` when it is 1-128 visible ASCII characters, else a generated one
    (it is echoed in a response header, forwarded to the engine and written to the ledger)."""
    presented = headers.get("x-request-id")
    if presented and _REQUEST_ID.fullmatch(presented):
        return presented
    return os.urandom(16).hex()


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key of `Authorization: Bearer KEY` or `x-api-key: KEY`, or None when none is given.

    A key that is not valid text cannot match any stored digest: it is returned as a marker that
    authenticates nobody, so the caller answers 401 like any wrong key.
    """
    auth = headers.get("Authorization")
    key: str | None = None
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            key = token.strip()
    if key is None:
        raw = headers.get("x-api-key")
        key = raw.strip() if raw else None
    if key is not None and not encodable(key):
        return INVALID_KEY
    return key or None


INVALID_KEY = "\x00invalid"  # no stored key can hash to this: keys never contain NUL


def bearer_token(headers: Mapping[str, str]) -> bytes:
    """The bearer token of `Authorization` as bytes (for a constant-time compare), b"" without one."""
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return token.strip().encode("utf-8", "surrogateescape")

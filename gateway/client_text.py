"""Text a client sent, on its way into the gateway's own records.

aiohttp decodes header values as UTF-8 and keeps undecodable bytes as lone surrogates
(`surrogateescape`), so a header can hold a `str` that no encoder accepts: orjson refuses it, and a
record holding it would fail to be written. A parsed JSON body never does (orjson rejects lone
surrogates when it parses), so headers, and the path and query they came with, are the way in.

Every writer of a JSON line that may carry such text (the usage ledger, the audit log) encodes it
with `json_line`: text that is not valid UTF-8 is written with replacement characters instead of
failing, so neither a record is lost nor a request answered 500 for bytes a client sent. A request
id is kept only when it is short visible ASCII (`REQUEST_ID`), the rule the inference routes apply
before echoing and forwarding it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

import orjson

MAX_REQUEST_ID_CHARS: Final = 128
REQUEST_ID: Final = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")


def encodable(value: str) -> bool:
    """True when `value` is valid text (no undecodable bytes smuggled in as surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_request_id(value: str | None) -> str | None:
    """`value` when it is 1-128 visible ASCII characters, else None."""
    return value if value and REQUEST_ID.fullmatch(value) else None


def valid_text(value: Any) -> Any:
    """`value` with every string (keys included, at any depth) made valid UTF-8."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(value, dict):
        return {valid_text(k): valid_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [valid_text(v) for v in value]
    return value


def json_line(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """One newline-terminated JSON line of `value`; invalid text is replaced, never an error (the
    cleaning pass runs only when the fast encode refused)."""
    try:
        return orjson.dumps(value, default=default, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return orjson.dumps(valid_text(value), default=default, option=orjson.OPT_APPEND_NEWLINE)

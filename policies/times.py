"""Times as people type them: durations (`90s`, `30m`, `24h`, `7d`, `2w`) and ISO-8601 times or
dates, in seconds. A key's expiry in the admin API and a usage report's window read the same forms."""

from __future__ import annotations

import re
from datetime import UTC, datetime

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration_s(text: str) -> float:
    """'90s', '30m', '24h', '7d', '2w' -> seconds; ValueError when it is none of them."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (e.g. 30m, 24h, 7d)")
    return float(m[1]) * _UNIT_S[m[2]]


def parse_iso_s(text: str) -> float:
    """An ISO-8601 time or date (UTC when it names no offset) -> unix seconds; ValueError if it is not one."""
    moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()

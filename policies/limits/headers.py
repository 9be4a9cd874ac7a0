"""Rate-limit and retry headers in OpenAI's format (OpenAI's "Rate limits" guide; openai-python's _base_client.py).

`x-ratelimit-*` describe the tightest bucket of each kind (fewest units left); resets are Go-style
durations (`1s`, `6m0s`, `2m59.56s`) = time until that bucket is full again. Retry headers carry
the true time until the request fits: `retry-after-ms` is what openai-python reads first, and
`retry-after` (whole seconds, rounded up) serves every other client. Waits over a minute also say
`x-should-retry: false`, because older SDKs ignore such delays and would retry at once.
"""

from __future__ import annotations

import math

Headers = list[tuple[str, str]]
MAX_AUTO_RETRY_S = 60.0


def go_duration(seconds: float) -> str:
    """Go's time.Duration.String() at millisecond resolution, rounded up: 0s, 12ms, 1.5s, 6m0s, 1h2m3s."""
    ms = math.ceil(seconds * 1000 - 1e-6) if seconds > 0 else 0
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_headers(kind: str, limit: float, remaining: float, reset_s: float) -> Headers:
    """The three x-ratelimit-* headers of one kind (`requests` or `tokens`)."""
    return [
        (f"x-ratelimit-limit-{kind}", str(int(limit))),
        (f"x-ratelimit-remaining-{kind}", str(max(0, math.floor(remaining)))),
        (f"x-ratelimit-reset-{kind}", go_duration(reset_s)),
    ]


def retry_headers(wait_s: float) -> Headers:
    """retry-after(-ms) for a wait of `wait_s` seconds (at least 1 ms / 1 s)."""
    headers = [
        ("retry-after", str(max(1, math.ceil(wait_s)))),
        ("retry-after-ms", str(max(1, math.ceil(wait_s * 1000)))),
    ]
    if wait_s > MAX_AUTO_RETRY_S:
        headers.append(("x-should-retry", "false"))
    return headers

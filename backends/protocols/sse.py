"""Server-sent event framing for typed event streams (Responses and Anthropic Messages).

Both APIs name each event twice, in the `event:` line and in the payload's `type`; chat
completions' stream uses bare `data:` lines instead.
"""

from __future__ import annotations

from typing import Any

import orjson


def typed_event(payload: dict[str, Any]) -> bytes:
    """``event: TYPE\\ndata: {json}\\n\\n`` for a payload carrying its own ``type``."""
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def split_event(raw: bytes) -> tuple[str | None, bytes | None]:
    """(event name, data payload) of one SSE event block (lines joined; comments dropped)."""
    name: str | None = None
    data: list[bytes] = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
    return name, (b"\n".join(data) if data else None)

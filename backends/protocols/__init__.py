"""Translations between the client APIs tokenway speaks and chat completions (`responses`, `anthropic`),
and what every translation shares, here: the one exception they raise, the server-sent event framing
of typed event streams, and the `cost_usd` extension of translated usage.

Why in backends
---------------
Pure translations between the client APIs tokenway speaks and chat completions.

Why in `backends/`: the simulated engine serves `/v1/responses` and `/v1/messages` by these same
translations (as vLLM serves them over its chat path), and the gateway uses them both to read those
APIs (token estimates, prefix hashing) and to serve them on engines that only speak chat
completions. Sharing one rendering keeps the gateway's prompt ids and the simulator's identical.
Everything here is a function of plain dicts: no sockets, no clocks, no state beyond one stream.

Errors
------
The one exception the translations raise: a client's body that cannot be translated (a 400).

Event framing
-------------
Server-sent event framing for typed event streams (Responses and Anthropic Messages).

Both APIs name each event twice, in the `event:` line and in the payload's `type`; chat
completions' stream uses bare `data:` lines instead.

Cost in usage
-------------
The gateway's one extension of the usage objects it translates: `cost_usd`.

A caller whose policy shows it the cost (`show_cost`, docs/governance.md) finds the dollars its
request cost in the answer's usage. The gateway writes it into the chat usage it translates from;
each API's usage object carries it over under the same name, and writes nothing otherwise, so the
bodies of every other caller stay exactly the API's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson


class ProtocolError(ValueError):
    """Malformed or unsupported input; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


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


def with_cost(usage: Mapping[str, Any]) -> dict[str, Any]:
    """`{"cost_usd": …}` when the chat usage carries it; nothing otherwise."""
    cost = usage.get("cost_usd")
    return {} if cost is None else {"cost_usd": cost}

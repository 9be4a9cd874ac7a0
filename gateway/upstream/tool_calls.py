"""Whether an engine's answer ended asking for tool calls: the boundary tool-boundary affinity
(`policies/routing/tool_affinity.py`) keeps a program's replica across.

Read from what the relay already holds (the parsed unary answer; each stream event's bytes), in the
three grammars an engine or a hosted provider answers in:

- chat completions: a choice's `finish_reason` is `tool_calls` (or the legacy `function_call`);
- Anthropic Messages: `stop_reason` is `tool_use`;
- Responses: an output item of type `function_call` (the model's turn ends there: the client must
  send the call's output back).

Streams are matched on bytes, not parsed: the relay does not parse every event, and these markers
appear only in the event that ends the answer (or announces a call), so a substring test per event
costs what `_FINISHED`'s does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

_TOOL_FINISH: Final = ("tool_calls", "function_call")
_MARKERS: Final = (
    b'"finish_reason":"tool_calls"',
    b'"finish_reason": "tool_calls"',
    b'"finish_reason":"function_call"',
    b'"stop_reason":"tool_use"',
    b'"stop_reason": "tool_use"',
    b'"type":"function_call"',
    b'"type": "function_call"',
)


def answer_calls_tools(body: Mapping[str, Any] | None) -> bool:
    """Whether a parsed (non-streamed) answer ends asking for tool calls."""
    if not body:
        return False
    choices = body.get("choices")
    if isinstance(choices, list):
        return any(isinstance(c, dict) and c.get("finish_reason") in _TOOL_FINISH for c in choices)
    if body.get("stop_reason") == "tool_use":
        return True
    output = body.get("output")
    if isinstance(output, list):
        return any(isinstance(item, dict) and item.get("type") == "function_call" for item in output)
    return False


def events_call_tools(events: Iterable[bytes]) -> bool:
    """Whether one of a stream's raw SSE events ends its answer in tool calls (or announces one)."""
    for event in events:
        # one cheap test before the exact markers
        if (b"_call" in event or b"tool_use" in event) and any(marker in event for marker in _MARKERS):
            return True
    return False

"""OpenAI Responses events from chat completion chunks: `ResponsesStream`.

The sequence is `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` … `.done`,
`response.function_call_arguments.delta` … `.done`, `response.output_item.done`, and
`response.completed` (or `response.incomplete` when cut by `max_output_tokens`, `response.failed` on
an error), each with its `sequence_number`. The response objects it builds are `responses.py`'s.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from backends.protocols.responses import (
    choice_logprobs,
    finish_status,
    function_call_item,
    message_item,
    new_id,
    skeleton,
    usage_object,
)
from backends.protocols.sse import typed_event


class ResponsesStream:
    """Chat completion chunks in, Responses events out (bytes, SSE-framed, numbered).

    Call `start()` once, `feed(chunk)` per parsed chat chunk, then `finish()` — or `fail()` when
    the upstream broke. `response` is the final object (with usage) once finished.
    """

    def __init__(
        self, request: Mapping[str, Any], model: str, response_id: str | None = None, created_at: int | None = None
    ) -> None:
        self.response = skeleton(request, response_id or new_id("resp"), created_at or int(time.time()), model)
        self.seq = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self._text_index: int | None = None  # output index of the open message item
        self._text: list[str] = []
        self._logprobs: list[Any] = []
        self._calls: dict[int, int] = {}  # chat tool-call index -> output index
        self._open_calls: list[int] = []
        self._arguments: dict[int, list[str]] = {}
        self.ended = False

    def _event(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self.seq
        self.seq += 1
        return typed_event(payload)

    def extension(self, payload: dict[str, Any]) -> bytes:
        """An event of the server's own (`type` outside OpenAI's), numbered in the stream's sequence:
        clients that do not know its type pass it by (tokenway's failover marker)."""
        return self._event(payload)

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": [dict(item) for item in self.response["output"]]}

    def start(self) -> bytes:
        return self._event({"type": "response.created", "response": self._snapshot()}) + self._event(
            {"type": "response.in_progress", "response": self._snapshot()}
        )

    def _open_text(self) -> bytes:
        index = len(self.response["output"])
        item = message_item(new_id("msg"), "", status="in_progress")
        item["content"] = []
        self.response["output"].append(item)
        self._text_index = index
        added = self._event({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return added + self._event(
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": part,
            }
        )

    def _close_text(self) -> bytes:
        index = self._text_index
        if index is None:
            return b""
        self._text_index = None
        item = self.response["output"][index]
        text = "".join(self._text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs}
        item["content"] = [part]
        item["status"] = "completed"
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        out = self._event({"type": "response.output_text.done", **common, "text": text, "logprobs": self._logprobs})
        out += self._event({"type": "response.content_part.done", **common, "part": part})
        return out + self._event({"type": "response.output_item.done", "output_index": index, "item": dict(item)})

    def _close_calls(self) -> bytes:
        out = b""
        for index in self._open_calls:
            item = self.response["output"][index]
            item["arguments"] = "".join(self._arguments.pop(index, []))
            item["status"] = "completed"
            out += self._event(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
            out += self._event({"type": "response.output_item.done", "output_index": index, "item": dict(item)})
        self._open_calls = []
        return out

    def feed(self, chunk: Mapping[str, Any]) -> bytes:
        """Events for one chat chunk (often none: role chunks, the usage chunk)."""
        if chunk.get("usage"):
            self.usage = dict(chunk["usage"])
        choices = chunk.get("choices") or ()
        if not choices:
            return b""
        choice = choices[0]
        out = b""
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content:
            if self._text_index is None:
                out += self._close_calls() + self._open_text()
            self._text.append(content)
            lps = choice_logprobs(choice)
            self._logprobs.extend(lps)
            item_id = self.response["output"][self._text_index]["id"]
            out += self._event(
                {
                    "type": "response.output_text.delta",
                    "item_id": item_id,
                    "output_index": self._text_index,
                    "content_index": 0,
                    "delta": content,
                    "logprobs": lps,
                }
            )
        for call in delta.get("tool_calls") or ():
            out += self._feed_call(call)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        return out

    def _feed_call(self, call: Mapping[str, Any]) -> bytes:
        out = b""
        position = int(call.get("index") or 0)
        function = call.get("function") or {}
        index = self._calls.get(position)
        if index is None:
            out += self._close_text()
            index = len(self.response["output"])
            self._calls[position] = index
            self._open_calls.append(index)
            item = function_call_item(
                new_id("fc"), str(call.get("id") or new_id("call")), str(function.get("name") or ""), "", "in_progress"
            )
            self.response["output"].append(item)
            out += self._event({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
        arguments = function.get("arguments")
        if arguments:
            self._arguments.setdefault(index, []).append(arguments)
            item_id = self.response["output"][index]["id"]
            out += self._event(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item_id,
                    "output_index": index,
                    "delta": arguments,
                }
            )
        return out

    def finish(self) -> bytes:
        """Close open items; `response.completed` (or `.incomplete`) with usage."""
        out = self._close_text() + self._close_calls()
        self.response["usage"] = usage_object(self.usage)
        finish_status(self.response, self.finish_reason)
        self.ended = True
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return out + self._event({"type": kind, "response": self._snapshot()})

    def fail(self, message: str, code: str = "server_error") -> bytes:
        """`response.failed` after whatever was streamed (the upstream broke mid-stream)."""
        self.response["status"] = "failed"
        self.response["error"] = {"code": code, "message": message}
        self.response["usage"] = usage_object(self.usage)
        self.ended = True
        return self._event({"type": "response.failed", "response": self._snapshot()})

"""OpenAI Responses <-> chat completions: requests and response objects, and the typed Responses event
stream built from chat chunks (`ResponsesStream`).

Requests and responses
----------------------
OpenAI Responses API ⇄ chat completions: requests, response objects and the typed event stream.

Request: `input` (a string, or a list of items: messages with text / image / file parts,
`function_call`, `function_call_output`, `reasoning` — dropped, as a chat template has no place for
it), `instructions` (a leading system message), function `tools` and `tool_choice`, `text.format`
(`text`, `json_object`, `json_schema`) → `response_format`, `max_output_tokens` → `max_tokens`.
Items of any other type are refused with the item's index in `param`, never passed on silently.

Response: a chat completion becomes a `response` object whose `output` holds one `message` item
(`output_text` content) and one `function_call` item per tool call; usage is renamed
(`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`). The event stream is
below.

The event stream
----------------
OpenAI Responses events from chat completion chunks: `ResponsesStream`.

The sequence is `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` … `.done`,
`response.function_call_arguments.delta` … `.done`, `response.output_item.done`, and
`response.completed` (or `response.incomplete` when cut by `max_output_tokens`, `response.failed` on
an error), each with its `sequence_number`. The response objects it builds are the ones above.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from backends.protocols import ProtocolError, typed_event, with_cost
from backends.types import answer_choices, call_index, object_field, objects, usage_count

_MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
_PASSED_FIELDS = ("temperature", "top_p", "user", "seed", "parallel_tool_calls", "top_k", "min_tokens")


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


# --- request -------------------------------------------------------------------------------------


def _text_of_parts(parts: list[Any], where: str) -> list[dict[str, Any]]:
    """Chat content parts of a Responses content list."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping):
            raise ProtocolError(f"{where}[{j}] must be an object", f"{where}[{j}]")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise ProtocolError(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
            out.append({"type": "text", "text": text})
        elif kind == "refusal":
            out.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                file_id = part.get("file_id")
                if not isinstance(file_id, str):
                    raise ProtocolError(f"{where}[{j}] needs an image_url or a file_id", f"{where}[{j}]")
                url = file_id
            image: dict[str, Any] = {"url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            out.append({"type": "image_url", "image_url": image})
        elif kind == "input_file":
            file = {k: part[k] for k in ("file_id", "file_data", "filename") if isinstance(part.get(k), str)}
            if not file:
                raise ProtocolError(f"{where}[{j}] needs a file_id or file_data", f"{where}[{j}]")
            out.append({"type": "file", "file": file})
        else:
            raise ProtocolError(f"{where}[{j}].type {kind!r} is not a supported content type", f"{where}[{j}].type")
    return out


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise ProtocolError(f"{where}.role must be one of {sorted(_MESSAGE_ROLES)}, got {role!r}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or an array of parts", f"{where}.content")
    parts = _text_of_parts(content, f"{where}.content")
    if parts and all(p["type"] == "text" for p in parts):
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def input_items(value: Any) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise ProtocolError("'input' must be a string or an array of items", "input")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ProtocolError(f"input[{i}] must be an object", f"input[{i}]")
    return value


def items_to_messages(items: Iterable[Mapping[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Chat messages of Responses input items (consecutive function calls share one assistant turn)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                raise ProtocolError(f"{where} needs string call_id, name and arguments", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ProtocolError(f"{where}.call_id must be a string", f"{where}.call_id")
            if isinstance(output, list):
                text = "".join(p["text"] for p in _text_of_parts(output, f"{where}.output") if p["type"] == "text")
            elif isinstance(output, str):
                text = output
            else:
                raise ProtocolError(f"{where}.output must be a string or an array of parts", f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        elif kind is None:
            raise ProtocolError(f"{where} needs a 'type' (or a 'role' for a message)", where)
        else:
            raise ProtocolError(f"{where}.type {kind!r} is not a supported input item type", f"{where}.type")
    return messages


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools; built-in tools (web search, …) are refused."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ProtocolError("'tools' must be an array", "tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise ProtocolError(f"tools[{i}].type {kind!r} is not supported (only 'function')", f"tools[{i}].type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"tools[{i}].name is required", f"tools[{i}].name")
        function: dict[str, Any] = {"name": name, "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ProtocolError("'tool_choice' must be 'auto', 'none', 'required' or a function", "tool_choice")


def response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise ProtocolError("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, Mapping)
        schema = fmt.get("schema")
        if not isinstance(schema, Mapping):
            raise ProtocolError("text.format.schema must be an object", "text.format.schema")
        spec: dict[str, Any] = {"name": str(fmt.get("name") or "response"), "schema": schema}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise ProtocolError("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format.type")


def to_chat(body: Mapping[str, Any], prior_items: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The chat completions request equivalent to a Responses request.

    `prior_items` are the items of the conversation so far (a `previous_response_id`'s input and
    output), placed after `instructions` and before this request's input.
    """
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ProtocolError("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    messages.extend(items_to_messages(prior_items, "previous_response"))
    messages.extend(items_to_messages(input_items(body.get("input"))))
    if not messages:
        raise ProtocolError("'input' must not be empty", "input")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = chat_tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ProtocolError("'max_output_tokens' must be an integer >= 1", "max_output_tokens")
        chat["max_tokens"] = limit
    for name in _PASSED_FIELDS:
        if body.get(name) is not None:
            chat[name] = body[name]
    top = body.get("top_logprobs")
    if top:
        chat["logprobs"], chat["top_logprobs"] = True, top
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# --- response ------------------------------------------------------------------------------------


def usage_object(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage renamed the Responses way."""
    if not usage or not isinstance(usage, Mapping):
        return None
    details = object_field(usage, "prompt_tokens_details")
    prompt = usage_count(usage.get("prompt_tokens"))
    completion = usage_count(usage.get("completion_tokens"))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": usage_count(details.get("cached_tokens"))},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
        **with_cost(usage),
    }


def message_item(item_id: str, text: str, status: str = "completed", logprobs: Any = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def skeleton(
    request: Mapping[str, Any], response_id: str, created_at: int, model: str, status: str = "in_progress"
) -> dict[str, Any]:
    """A response object echoing the request's settings, with no output yet."""
    text = request.get("text") if isinstance(request.get("text"), Mapping) else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": request.get("metadata") or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": request.get("store", True),
        "temperature": request.get("temperature", 1.0),
        "text": text or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p", 1.0),
        "truncation": request.get("truncation", "disabled"),
        "usage": None,
        "user": request.get("user"),
    }


def finish_status(response: dict[str, Any], finish_reason: str | None) -> None:
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def choice_logprobs(choice: Mapping[str, Any]) -> list[dict[str, Any]]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    return list(content) if isinstance(content, list) else []


def from_chat(
    chat: Mapping[str, Any], request: Mapping[str, Any], response_id: str | None = None, model: str | None = None
) -> dict[str, Any]:
    """The response object for a chat completion answering `to_chat(request)`."""
    created = chat.get("created")
    created = created if type(created) is int and created > 0 else int(time.time())
    response = skeleton(request, response_id or new_id("resp"), created, model or str(chat.get("model", "")))
    choices = answer_choices(chat)
    choice = choices[0] if choices else {}
    message = object_field(choice, "message")
    content = message.get("content")
    if content:
        response["output"].append(message_item(new_id("msg"), str(content), logprobs=choice_logprobs(choice)))
    for call in objects(message.get("tool_calls")):
        function = object_field(call, "function")
        response["output"].append(
            function_call_item(
                new_id("fc"),
                str(call.get("id") or new_id("call")),
                str(function.get("name", "")),
                str(function.get("arguments", "")),
            )
        )
    response["usage"] = usage_object(chat.get("usage"))
    finish = choice.get("finish_reason")
    finish_status(response, finish if isinstance(finish, str) else None)
    return response


def conversation_items(request: Mapping[str, Any], response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """This turn's input items followed by its output items: what a `previous_response_id` continues.

    The request's and the response's own item objects, not copies: the store serializes them at
    once, and a stored conversation is decoded afresh for each later turn."""
    items = list(input_items(request.get("input")))
    kept = ("message", "function_call")
    items.extend(i for i in response.get("output") or () if type(i) is dict and i.get("type") in kept)
    return items


def output_text(response: Mapping[str, Any]) -> str:
    """The concatenated output text (the SDK's `response.output_text`)."""
    pieces: list[str] = []
    for item in response.get("output") or ():
        if isinstance(item, Mapping) and item.get("type") == "message":
            pieces.extend(str(p.get("text", "")) for p in item.get("content") or () if p.get("type") == "output_text")
    return "".join(pieces)


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
        usage = chunk.get("usage")
        if type(usage) is dict and usage:
            self.usage = dict(usage)
        choices = answer_choices(chunk)
        if not choices:
            return b""
        choice = choices[0]
        out = b""
        delta = object_field(choice, "delta")
        content = delta.get("content")
        if isinstance(content, str) and content:
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
        for call in objects(delta.get("tool_calls")):
            out += self._feed_call(call)
        if isinstance(choice.get("finish_reason"), str) and choice["finish_reason"]:
            self.finish_reason = choice["finish_reason"]
        return out

    def _feed_call(self, call: Mapping[str, Any]) -> bytes:
        out = b""
        position = call_index(call)
        function = object_field(call, "function")
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
        if isinstance(arguments, str) and arguments:
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

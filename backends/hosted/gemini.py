"""Google Gemini (Gemini API and Vertex AI) `generateContent` / `streamGenerateContent` ⇄ chat completions.

Where: a target model `gemini-2.5-flash` is the Gemini API (`/v1beta/models/{m}:generateContent`,
authenticated by an `x-goog-api-key` header: `api_key_headers`); a full resource name
`projects/{p}/locations/{l}/publishers/google/models/{m}` is Vertex AI (`/v1/{name}:generateContent`,
a bearer token from google-auth: `VertexToken`). `target.api_version` overrides the version segment.
Streams are `:streamGenerateContent?alt=sse`.

Request: `system` / `developer` messages → `systemInstruction` (hoisted); user and assistant turns
→ `contents` with roles `user` / `model` (consecutive turns of one role merged); text parts → `text`,
images → `inlineData` (data URLs) or `fileData` (`gs://` and web URLs on Vertex, Files API URIs on
either); assistant `tool_calls` → `functionCall` parts and `tool` messages → `functionResponse`
parts (named after the call they answer; a JSON object result is passed as is, anything else as
`{"output": ...}`); `tools` → one `functionDeclarations` tool (`parametersJsonSchema`, so JSON
Schema passes unchanged); `tool_choice` → `toolConfig.functionCallingConfig` (`auto` AUTO,
`required` ANY, `none` NONE, a named function ANY with `allowedFunctionNames`); `response_format`
`json_schema` → `responseMimeType: application/json` + `responseJsonSchema`, `json_object` → the
MIME type alone; `max_tokens` / `max_completion_tokens` → `maxOutputTokens`, `temperature`,
`top_p`, `seed`, `presence_penalty`, `frequency_penalty`, `stop` (`stopSequences`), `n`
(`candidateCount`); a chat extension `cached_content` (a `cachedContents/...` name) → `cachedContent`.

`reasoning_effort` → `generationConfig.thinkingConfig`: `none` thinkingBudget 0 (off), minimal 512,
low 1024, medium 8192, high 24576, with `includeThoughts` so the thoughts come back as
`reasoning_content`. A function call's `thoughtSignature` (which thinking models want back with the
call, and Gemini 3 requires) rides in the tool call's id (`pack_call_id`) and is restored from it.
`cache_control` markers are accepted and have no effect: Gemini caches
prefixes implicitly, and explicitly only through `cachedContent`.

`input_audio` parts and inline `file` parts (data URLs: PDFs and the like) → `inlineData`.

Refused (`Untranslatable`, or listed as dropped when the target allows): `logprobs`, `top_logprobs`,
`logit_bias`, `parallel_tool_calls: false`, `user`, `metadata`, `store`, `file` parts naming an
uploaded `file_id`, web image URLs on the Gemini API, and any field this codec does not know.

Usage: `promptTokenCount` already holds `cachedContentTokenCount` (the cache read); output is
`candidatesTokenCount` plus `thoughtsTokenCount` (billed as output, reported as reasoning). Gemini
has no per-request cache writes (an explicit cache is created, and billed for storage, apart).
Errors are `{"error": {code, message, status}}`; a `RetryInfo` detail gives `retry_after_s`.
The codec is pure: ids are derived from the answer's bytes and `created` is 0 (the transport
stamps both).
"""

from __future__ import annotations

import hashlib
import mimetypes
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import orjson

from backends.hosted.base import (
    ProviderError,
    ProviderStreamError,
    ProviderTarget,
    ProviderUsage,
    RateLimitState,
    UpstreamCall,
)
from backends.hosted.chat_in import (
    Refusals,
    Turns,
    content_parts,
    image_url,
    pack_signed_id,
    tool_arguments,
    tool_function,
    unpack_signed_id,
)
from backends.protocols import ProtocolError
from backends.types import EventBuffer, usage_count

__all__ = [
    "THINKING_BUDGETS",
    "GeminiCodec",
    "GeminiStreamDecoder",
    "VertexToken",
    "api_key_headers",
    "base_url",
    "pack_call_id",
    "unpack_call_id",
]

THINKING_BUDGETS: dict[str, int] = {"none": 0, "minimal": 512, "low": 1024, "medium": 8192, "high": 24576}

_FINISH = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
    "MODEL_ARMOR": "content_filter",
}
# google.rpc status → (answer status, OpenAI-style kind, worth a fallback)
_STATUSES: dict[str, tuple[int, str, bool]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", False),
    "FAILED_PRECONDITION": (400, "invalid_request_error", False),
    "OUT_OF_RANGE": (400, "invalid_request_error", False),
    "UNAUTHENTICATED": (401, "authentication_error", False),
    "PERMISSION_DENIED": (403, "permission_error", False),
    "NOT_FOUND": (404, "not_found_error", False),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", True),
    "CANCELLED": (499, "api_error", True),
    "INTERNAL": (500, "api_error", True),
    "UNKNOWN": (500, "api_error", True),
    "UNAVAILABLE": (503, "overloaded_error", True),
    "DEADLINE_EXCEEDED": (504, "timeout_error", True),
}
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,(?P<data>.*)$", re.S)
_DURATION = re.compile(r"^(?P<s>\d+(\.\d+)?)s$")

_KNOWN = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "tools",
    "tool_choice",
    "response_format",
    "stream",
    "stream_options",
    "reasoning_effort",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "parallel_tool_calls",
    "user",
    "metadata",
    "store",
    "cached_content",
}


def api_key_headers(api_key: str) -> dict[str, str]:
    """The Gemini API's key header (the transport adds it; keys never enter the codec's output)."""
    return {"x-goog-api-key": api_key}


class VertexToken:
    """A google-auth bearer token for Vertex AI; `refresh` blocks (metadata server, token endpoint).

    Run `refresh` off the event loop at start-up and before `expires_at`, never per request.
    google-auth is optional (`pip install 'tokenway[vertex]'`), imported on first use.
    """

    SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)

    def __init__(self, credentials: Any = None) -> None:
        self._credentials = credentials

    def refresh(self) -> tuple[str, Any]:
        """(access token, expiry as a naive UTC datetime or None) from application default credentials."""
        try:
            import google.auth
            import google.auth.transport.requests
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError("Vertex AI pools need google-auth: pip install 'tokenway[vertex]'") from exc
        if self._credentials is None:
            self._credentials, _project = google.auth.default(scopes=list(self.SCOPES))
        self._credentials.refresh(google.auth.transport.requests.Request())
        return str(self._credentials.token), self._credentials.expiry

    @staticmethod
    def headers(token: str) -> dict[str, str]:
        return {"authorization": f"Bearer {token}"}


def is_vertex(model: str) -> bool:
    return model.startswith("projects/")


def base_url(model: str) -> str:
    """The default base URL for a target model: the Gemini API, or Vertex AI in the resource's location."""
    if not is_vertex(model):
        return "https://generativelanguage.googleapis.com"
    parts = model.split("/")
    location = parts[3] if len(parts) > 3 and parts[2] == "locations" else "global"
    if location == "global":
        return "https://aiplatform.googleapis.com"
    return f"https://{location}-aiplatform.googleapis.com"


def _image_part(url: Any, where: str, vertex: bool, refusals: Refusals) -> dict[str, Any] | None:
    if not isinstance(url, str):
        raise ProtocolError(f"{where}.image_url.url must be a string", f"{where}.image_url.url")
    match = _DATA_URL.match(url)
    if match is not None:
        return {"inlineData": {"mimeType": (match.group("mime") or "image/png").lower(), "data": match["data"].strip()}}
    files_api = url.startswith("https://generativelanguage.googleapis.com/")
    if files_api or (vertex and url.startswith(("gs://", "https://", "http://"))):
        mime = mimetypes.guess_type(url.split("?", 1)[0])[0] or "image/jpeg"
        return {"fileData": {"mimeType": mime, "fileUri": url}}
    refusals.refuse(f"{where}.image_url", "the Gemini API takes images inline or as Files API URIs, not web URLs")
    return None


def _parts(content: Any, where: str, vertex: bool, refusals: Refusals, *, images: bool = True) -> list[dict[str, Any]]:
    def convert(kind: Any, part: Mapping[str, Any], at: str) -> list[dict[str, Any]] | None:
        if not images:
            return None
        if kind == "image_url":
            converted = _image_part(image_url(part), at, vertex, refusals)
        elif kind == "input_audio":
            converted = _audio_part(part.get("input_audio"), at)
        elif kind == "file":
            converted = _file_part(part.get("file"), at, refusals)
        else:
            return None
        return [converted] if converted is not None else []

    return content_parts(content, where, refusals, convert)


def _audio_part(audio: Any, where: str) -> dict[str, Any]:
    """Chat's `input_audio` (base64 and a format) → `inlineData`: Gemini hears audio natively."""
    if not isinstance(audio, Mapping) or not isinstance(audio.get("data"), str):
        raise ProtocolError(f"{where}.input_audio.data must be a base64 string", f"{where}.input_audio.data")
    audio_format = str(audio.get("format") or "wav").lower()
    mime = {"mp3": "audio/mp3", "wav": "audio/wav"}.get(audio_format, f"audio/{audio_format}")
    return {"inlineData": {"mimeType": mime, "data": audio["data"]}}


def _file_part(file: Any, where: str, refusals: Refusals) -> dict[str, Any] | None:
    """Chat's `file` part: inline `file_data` (a data URL) → `inlineData` (PDFs and the like); an
    uploaded `file_id` names a file in another provider's store: refused."""
    data = file.get("file_data") if isinstance(file, Mapping) else None
    if not isinstance(data, str):
        refusals.refuse(f"{where}.file", "only inline file_data (a data URL) can be sent")
        return None
    match = _DATA_URL.match(data)
    if match is None:
        raise ProtocolError(f"{where}.file.file_data must be a base64 data URL", f"{where}.file.file_data")
    return {
        "inlineData": {"mimeType": (match.group("mime") or "application/pdf").lower(), "data": match["data"].strip()}
    }


def _arguments(arguments: Any, where: str) -> dict[str, Any]:
    value = tool_arguments(arguments, where)
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return value


def _tool_response(content: Any, where: str, refusals: Refusals) -> dict[str, Any]:
    if isinstance(content, list):
        texts = [p.get("text") for p in _parts(content, where, False, refusals, images=False) if "text" in p]
        content = "".join(str(t) for t in texts)
    if isinstance(content, str):
        try:
            value = orjson.loads(content)
        except orjson.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            return value
        return {"output": content}
    if content is None:
        return {"output": ""}
    raise ProtocolError(f"{where}.content must be a string or an array of text parts", f"{where}.content")


def _contents(messages: Any, vertex: bool, refusals: Refusals) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system instruction parts, contents)."""
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty array", "messages")
    system: list[dict[str, Any]] = []
    turns = Turns("parts")
    add = turns.add
    names: dict[str, str] = {}  # tool call id → function name

    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ProtocolError(f"{where} must be an object", where)
        role = message.get("role")
        if role in ("system", "developer"):
            system.extend(_parts(message.get("content"), where, vertex, refusals, images=False))
        elif role == "user":
            add("user", _parts(message.get("content"), where, vertex, refusals))
        elif role == "assistant":
            parts = _parts(message.get("content"), where, vertex, refusals, images=False)
            for k, call in enumerate(message.get("tool_calls") or []):
                at = f"{where}.tool_calls[{k}]"
                function = tool_function(call, at)
                functioncall: dict[str, Any] = {
                    "name": function["name"],
                    "args": _arguments(function.get("arguments"), at),
                }
                part: dict[str, Any] = {"functionCall": functioncall}
                if isinstance(call.get("id"), str):
                    names[call["id"]] = function["name"]
                    own_id, signature = unpack_call_id(call["id"])
                    if not vertex:
                        functioncall["id"] = own_id
                    if signature:
                        part["thoughtSignature"] = signature
                parts.append(part)
            add("model", parts)
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ProtocolError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
            name = names.get(call_id) or message.get("name")
            if not isinstance(name, str):
                raise ProtocolError(
                    f"{where}.tool_call_id {call_id!r} answers no earlier tool call (Gemini needs its name)",
                    f"{where}.tool_call_id",
                )
            response: dict[str, Any] = {
                "name": name,
                "response": _tool_response(message.get("content"), where, refusals),
            }
            if not vertex:
                response["id"] = unpack_call_id(call_id)[0]
            add("user", [{"functionResponse": response}])
        else:
            raise ProtocolError(f"{where}.role {role!r} is not supported", f"{where}.role")
    if not turns.turns:
        raise ProtocolError("messages holds no user or assistant content", "messages")
    return system, turns.turns


def _tools(chat: Mapping[str, Any], refusals: Refusals) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    tools = chat.get("tools")
    choice = chat.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ProtocolError("tool_choice needs tools", "tool_choice")
        return [], None
    if not isinstance(tools, list):
        raise ProtocolError("tools must be an array", "tools")
    declarations: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            refusals.refuse(f"{at}.type", "only function tools are supported")
            continue
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ProtocolError(f"{at}.function.name must be a string", f"{at}.function.name")
        declaration: dict[str, Any] = {"name": function["name"]}
        if function.get("description"):
            declaration["description"] = function["description"]
        if function.get("parameters"):
            declaration["parametersJsonSchema"] = function["parameters"]
        declarations.append(declaration)
    config: dict[str, Any] | None
    if choice in (None, "auto"):
        config = None
    elif choice == "none":
        config = {"functionCallingConfig": {"mode": "NONE"}}
    elif choice == "required":
        config = {"functionCallingConfig": {"mode": "ANY"}}
    elif isinstance(choice, Mapping) and isinstance((choice.get("function") or {}).get("name"), str):
        config = {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [choice["function"]["name"]]}}
    else:
        raise ProtocolError("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
    return ([{"functionDeclarations": declarations}] if declarations else []), config


def _number(chat: Mapping[str, Any], name: str) -> float | int | None:
    value = chat.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ProtocolError(f"{name} must be a number", name)
    return value


class GeminiCodec:
    """Chat completions ⇄ `generateContent` on the Gemini API or Vertex AI."""

    name = "gemini"

    def path(self, target: ProviderTarget, stream: bool) -> str:
        if is_vertex(target.model):
            version = target.api_version or "v1"
            resource = target.model
        else:
            version = target.api_version or "v1beta"
            resource = "models/" + quote(target.model, safe="")
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        return f"/{version}/{resource}:{method}"

    def request(self, chat: Mapping[str, Any], target: ProviderTarget) -> UpstreamCall:
        refusals = Refusals(target.allow_drop, "Gemini")
        for key in chat:
            if key not in _KNOWN:
                refusals.refuse(key, "unknown field")
        if chat.get("logprobs"):
            refusals.refuse("logprobs", "log probabilities are not translated")
        if chat.get("top_logprobs") is not None:
            refusals.refuse("top_logprobs", "log probabilities are not translated")
        if chat.get("logit_bias"):
            refusals.refuse("logit_bias", "no logit bias")
        if chat.get("parallel_tool_calls") is False:
            refusals.refuse("parallel_tool_calls", "parallel function calls cannot be turned off")
        for name in ("user", "metadata"):
            if chat.get(name):
                refusals.refuse(name, "no end-user or metadata field")
        if chat.get("store"):
            refusals.refuse("store", "nothing is stored")

        vertex = is_vertex(target.model)
        system, contents = _contents(chat.get("messages"), vertex, refusals)
        body: dict[str, Any] = {"contents": contents}
        if system:
            body["systemInstruction"] = {"parts": system}
        tools, tool_config = _tools(chat, refusals)
        if tools:
            body["tools"] = tools
        if tool_config is not None:
            body["toolConfig"] = tool_config

        generation: dict[str, Any] = {}
        for name in ("max_completion_tokens", "max_tokens"):
            value = chat.get(name)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ProtocolError(f"{name} must be a positive integer", name)
                generation["maxOutputTokens"] = value
                break
        for name, key in (
            ("temperature", "temperature"),
            ("top_p", "topP"),
            ("presence_penalty", "presencePenalty"),
            ("frequency_penalty", "frequencyPenalty"),
        ):
            value = _number(chat, name)
            if value is not None:
                generation[key] = value
        seed = chat.get("seed")
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise ProtocolError("seed must be an integer", "seed")
            generation["seed"] = seed
        n = chat.get("n")
        if n is not None and n != 1:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ProtocolError("n must be a positive integer", "n")
            generation["candidateCount"] = n
        stop = chat.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ProtocolError("stop must be a string or an array of strings", "stop")
            if stops:
                generation["stopSequences"] = stops
        response_format = chat.get("response_format")
        if isinstance(response_format, Mapping):
            kind = response_format.get("type")
            if kind == "json_schema":
                spec = response_format.get("json_schema")
                if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
                    raise ProtocolError("response_format.json_schema.schema must be an object", "response_format")
                generation["responseMimeType"] = "application/json"
                generation["responseJsonSchema"] = spec["schema"]
            elif kind == "json_object":
                generation["responseMimeType"] = "application/json"
            elif kind != "text":
                raise ProtocolError(f"response_format.type {kind!r} is not supported", "response_format.type")
        effort = chat.get("reasoning_effort")
        if effort is not None:
            if effort not in THINKING_BUDGETS:
                raise ProtocolError(
                    f"reasoning_effort must be one of {', '.join(THINKING_BUDGETS)}", "reasoning_effort"
                )
            budget = THINKING_BUDGETS[effort]
            generation["thinkingConfig"] = {"thinkingBudget": budget, "includeThoughts": budget > 0}
        if generation:
            body["generationConfig"] = generation
        cached = chat.get("cached_content")
        if cached is not None:
            if not isinstance(cached, str) or not cached:
                raise ProtocolError("cached_content must be a cachedContents/... name", "cached_content")
            body["cachedContent"] = cached

        stream = bool(chat.get("stream"))
        headers = [("content-type", "application/json")]
        headers.extend((k.lower(), v) for k, v in target.extra_headers.items())
        return UpstreamCall(
            method="POST",
            path=self.path(target, stream),
            headers=tuple(headers),
            body=orjson.dumps(body),
            stream=stream,
            dropped=tuple(refusals.dropped),
        )

    def answer(self, body: bytes, target: ProviderTarget) -> tuple[dict[str, Any], ProviderUsage]:
        data = orjson.loads(body)
        choices: list[dict[str, Any]] = []
        for position, candidate in enumerate(data.get("candidates") or []):
            index = int(candidate.get("index", position))
            texts: list[str] = []
            thoughts: list[str] = []
            calls: list[dict[str, Any]] = []
            for part in (candidate.get("content") or {}).get("parts") or []:
                if "functionCall" in part:
                    calls.append(_tool_call(part["functionCall"], index, len(calls), part.get("thoughtSignature")))
                elif "text" in part:
                    (thoughts if part.get("thought") else texts).append(part["text"])
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
            if calls:
                message["tool_calls"] = calls
            if thoughts:
                message["reasoning_content"] = "".join(thoughts)
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "finish_reason": _finish(candidate.get("finishReason"), bool(calls)),
                    "logprobs": None,
                }
            )
        if not choices:  # the prompt itself was blocked (promptFeedback.blockReason)
            choices.append(
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ""},
                    "finish_reason": "content_filter",
                    "logprobs": None,
                }
            )
        usage = usage_from(data.get("usageMetadata") or {})
        completion = {
            "id": "chatcmpl-" + hashlib.blake2b(body, digest_size=12).hexdigest(),
            "object": "chat.completion",
            "created": 0,
            "model": str(data.get("modelVersion") or target.model.rsplit("/", 1)[-1]),
            "choices": choices,
            "usage": usage.chat_usage(),
        }
        return completion, usage

    def stream(self, target: ProviderTarget) -> GeminiStreamDecoder:
        return GeminiStreamDecoder(target.model.rsplit("/", 1)[-1])

    def error(self, status: int, headers: Mapping[str, str], body: bytes) -> ProviderError:
        try:
            data = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            data = {}
        if isinstance(data, list) and data:  # a stream's error arrives as a one-element array
            data = data[0]
        error = data.get("error") if isinstance(data, Mapping) else None
        if not isinstance(error, Mapping):
            text = body.decode("utf-8", "replace")[:500] or f"Gemini answered {status}"
            error = {"code": status, "message": text}
        retry = _retry_after(error)
        if retry is None:
            retry = _header_retry_after(headers)
        return error_from(error, status, retry)

    def rate_limits(self, headers: Mapping[str, str]) -> RateLimitState:
        """Gemini publishes no remaining-quota headers: only a throttled answer's `retry-after`, if any."""
        return RateLimitState(reset_s=_header_retry_after(headers))


def _header_retry_after(headers: Mapping[str, str]) -> float | None:
    for key, value in headers.items():
        if key.lower() == "retry-after":
            try:
                return max(float(value), 0.0)
            except ValueError:
                return None
    return None


def _retry_after(error: Mapping[str, Any]) -> float | None:
    for detail in error.get("details") or []:
        if isinstance(detail, Mapping) and str(detail.get("@type", "")).endswith("google.rpc.RetryInfo"):
            match = _DURATION.match(str(detail.get("retryDelay", "")))
            if match:
                return float(match["s"])
    return None


def error_from(error: Mapping[str, Any], status: int, retry_after_s: float | None = None) -> ProviderError:
    """A `{code, message, status}` error object → ProviderError."""
    name = str(error.get("status") or "")
    code = int(error.get("code") or status or 500)
    known = _STATUSES.get(name)
    if known is None:
        retryable = code >= 500 or code == 429
        kind = "rate_limit_error" if code == 429 else "api_error" if code >= 500 else "invalid_request_error"
        known = (code if code >= 400 else 502, kind, retryable)
    message = str(error.get("message") or f"Gemini answered {code}")
    return ProviderError(
        status=known[0],
        kind=known[1],
        message=f"{name}: {message}" if name else message,
        retryable=known[2],
        retry_after_s=retry_after_s,
    )


_SIGNED = "gts-"


def pack_call_id(call_id: str, signature: str | None) -> str:
    """A call's id carries its `thoughtSignature`: Gemini 3 refuses a function call returned without it."""
    return pack_signed_id(call_id, signature, _SIGNED)


def unpack_call_id(value: str) -> tuple[str, str | None]:
    """(the call's own id, its thoughtSignature or None)"""
    return unpack_signed_id(value, _SIGNED)


def _tool_call(call: Mapping[str, Any], candidate: int, position: int, signature: str | None = None) -> dict[str, Any]:
    call_id = str(call.get("id") or f"call_{candidate}_{position}")
    return {
        "id": pack_call_id(call_id, signature),
        "type": "function",
        "function": {"name": str(call.get("name", "")), "arguments": orjson.dumps(call.get("args") or {}).decode()},
    }


def _finish(reason: Any, calls: bool) -> str:
    if calls and reason in (None, "STOP"):
        return "tool_calls"
    return _FINISH.get(str(reason), "stop")


def usage_from(usage: Mapping[str, Any]) -> ProviderUsage:
    """usageMetadata → ProviderUsage (prompt counts include the cache read; thoughts are billed output)."""
    thoughts = usage_count(usage.get("thoughtsTokenCount"))
    prompt = usage_count(usage.get("promptTokenCount")) + usage_count(usage.get("toolUsePromptTokenCount"))
    return ProviderUsage(
        input_tokens=prompt,
        output_tokens=usage_count(usage.get("candidatesTokenCount")) + thoughts,
        cache_read_tokens=usage_count(usage.get("cachedContentTokenCount")),
        reasoning_tokens=thoughts,
    )


class GeminiStreamDecoder:
    """`streamGenerateContent?alt=sse` events → chat.completion.chunk dicts (usage in the last one)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._buffer = EventBuffer(crlf=True)  # the provider's stream is input: bounded, read once
        self._id = "chatcmpl-gemini"
        self._started: set[int] = set()
        self._calls: dict[int, int] = {}  # candidate → tool calls so far
        self._finished: set[int] = set()
        self._usage_meta: Mapping[str, Any] | None = None
        self._usage: ProviderUsage | None = None
        self._seen_any = False

    @property
    def usage(self) -> ProviderUsage | None:
        return self._usage

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self.model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in self._buffer.feed(data):
            payload = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
            if payload:
                out.extend(self._event(payload))
        return out

    def _event(self, payload: bytes) -> list[dict[str, Any]]:
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise ProviderStreamError(ProviderError(502, "api_error", "corrupt Gemini stream event", True)) from exc
        if isinstance(data, Mapping) and isinstance(data.get("error"), Mapping):
            raise ProviderStreamError(error_from(data["error"], 500, _retry_after(data["error"])))
        if not self._seen_any:
            self._seen_any = True
            self._id = "chatcmpl-" + (
                str(data.get("responseId"))
                if data.get("responseId")
                else hashlib.blake2b(payload, digest_size=12).hexdigest()
            )
        if data.get("usageMetadata"):
            self._usage_meta = data["usageMetadata"]
        out: list[dict[str, Any]] = []
        for position, candidate in enumerate(data.get("candidates") or []):
            index = int(candidate.get("index", position))
            if index not in self._started:
                self._started.add(index)
                out.append(self._chunk(index, {"role": "assistant", "content": ""}))
            for part in (candidate.get("content") or {}).get("parts") or []:
                if "functionCall" in part:
                    n = self._calls.get(index, 0)
                    self._calls[index] = n + 1
                    call = _tool_call(part["functionCall"], index, n, part.get("thoughtSignature"))
                    out.append(self._chunk(index, {"tool_calls": [{"index": n, **call}]}))
                elif part.get("text"):
                    key = "reasoning_content" if part.get("thought") else "content"
                    out.append(self._chunk(index, {key: part["text"]}))
            reason = candidate.get("finishReason")
            if reason and index not in self._finished:
                self._finished.add(index)
                out.append(self._chunk(index, {}, _finish(reason, bool(self._calls.get(index)))))
        if not data.get("candidates") and (data.get("promptFeedback") or {}).get("blockReason"):
            self._finished.add(0)
            out.append(self._chunk(0, {}, "content_filter"))
        return out

    def close(self) -> list[dict[str, Any]]:
        last = self._buffer.rest()
        if last.strip():
            self.feed(last + b"\n\n")
        if not self._finished:
            raise ProviderStreamError(
                ProviderError(502, "api_error", "the Gemini stream ended before a finishReason", retryable=True)
            )
        self._usage = usage_from(self._usage_meta or {})
        chunk = self._chunk(0, {})
        chunk["choices"] = []
        chunk["usage"] = self._usage.chat_usage()
        return [chunk]

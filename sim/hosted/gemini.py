"""Gemini stand-in: the Gemini API and Vertex AI `generateContent`, streamed or not, with context caching.

`python -m sim.hosted gemini --port N`. Routes, in the shapes google-genai parses (it is the
tests' client):

- POST /{version}/models/{model}:generateContent and :streamGenerateContent?alt=sse (Gemini API,
  `x-goog-api-key` or `?key=`, or a bearer token), and the same under
  /{version}/projects/{p}/locations/{l}/publishers/google/models/{model}:... (Vertex AI: bearer only).
  The key / token is `--api-key`: none is PERMISSION_DENIED (403) or UNAUTHENTICATED (401 on
  Vertex), a wrong key INVALID_ARGUMENT "API key not valid".
- POST /{version}/cachedContents, GET and DELETE /{version}/cachedContents/{id}: explicit context
  caches (at least 1024 tokens); a request naming one in `cachedContent` is billed its tokens as
  `cachedContentTokenCount` (inside `promptTokenCount`, as Gemini reports it).
- implicit caching: a request whose leading turns (at least 1024 tokens) were seen in the last five
  minutes reports them as cached, as Gemini 2.5 models do; no cache writes are billed.

Requests are validated as the API does (unknown fields by name, roles `user` / `model`, one data
member per part, `responseJsonSchema` only with `responseMimeType: application/json`, thinking
budgets within 0..24576 or -1, candidateCount at most 8): INVALID_ARGUMENT (400). Over `--rpm` /
`--tpm` a call gets RESOURCE_EXHAUSTED (429) with a RetryInfo detail (Gemini sends no quota
headers). `--fail-after-tokens` ends a stream with an `{"error": ...}` event. Answers are seeded
words: a `functionCall` when the calling mode asks for one (on AUTO, when the last user turn holds
no function response), JSON following the response schema, thoughts first when thinking is on
(`thought: true` parts only with `includeThoughts`). A thinking answer's function call carries a
`thoughtSignature`; `gemini-3*` models always think and, as Gemini 3 does, refuse a conversation
whose earlier function calls come back without the signature issued for them.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from sim.hosted.common import (
    CONFIG,
    FAULTS,
    TALLY,
    Latency,
    PromptCache,
    RateLimiter,
    StandinConfig,
    Talker,
    base_app,
    count_tokens,
    json_response,
)

MIN_CACHE_TOKENS = 1024
IMAGE_TOKENS = 258
_VERSIONS = ("v1", "v1beta", "v1alpha", "v1beta1")
_IMPLICIT_TTL_S = 300.0

_TOP_LEVEL = {
    "contents",
    "systemInstruction",
    "system_instruction",
    "tools",
    "toolConfig",
    "tool_config",
    "generationConfig",
    "generation_config",
    "safetySettings",
    "safety_settings",
    "cachedContent",
    "cached_content",
    "labels",
    "model",
}
_GENERATION = {
    "stopSequences",
    "responseMimeType",
    "responseSchema",
    "responseJsonSchema",
    "responseModalities",
    "candidateCount",
    "maxOutputTokens",
    "temperature",
    "topP",
    "topK",
    "seed",
    "presencePenalty",
    "frequencyPenalty",
    "responseLogprobs",
    "logprobs",
    "thinkingConfig",
    "mediaResolution",
    "speechConfig",
}
_PART_DATA = {
    "text",
    "inlineData",
    "fileData",
    "functionCall",
    "functionResponse",
    "executableCode",
    "codeExecutionResult",
}
_PART_META = {"thought", "thoughtSignature", "videoMetadata", "partMetadata", "mediaResolution"}
_CODES = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
# A fault a test queues (POST /standin/faults {"status": N}) → the google.rpc status Gemini answers with
# (529, Anthropic's "overloaded", is Gemini's 503 "model is overloaded").
_FAULTS = {
    400: ("INVALID_ARGUMENT", "Request contains an invalid argument."),
    401: ("UNAUTHENTICATED", "Request had invalid authentication credentials."),
    403: ("PERMISSION_DENIED", "The caller does not have permission."),
    404: ("NOT_FOUND", "Requested entity was not found."),
    429: ("RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota)."),
    500: ("INTERNAL", "An internal error has occurred."),
    503: ("UNAVAILABLE", "The model is overloaded. Please try again later."),
    504: ("DEADLINE_EXCEEDED", "Deadline expired before operation could complete."),
    529: ("UNAVAILABLE", "The model is overloaded. Please try again later."),
}

_LIMITER: web.AppKey[RateLimiter] = web.AppKey("gemini_limiter", RateLimiter)
_IMPLICIT: web.AppKey[PromptCache] = web.AppKey("gemini_implicit_cache", PromptCache)


@dataclass(slots=True)
class _Cached:
    name: str
    model: str
    tokens: int
    expires: float
    created: str


_CACHES: web.AppKey[dict[str, _Cached]] = web.AppKey("gemini_caches", dict)


class _Refused(Exception):
    def __init__(self, status: str, message: str, details: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.details = details or []

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": _CODES.get(self.status, 400), "message": self.message, "status": self.status}
        if self.details:
            error["details"] = self.details
        return {"error": error}

    def response(self) -> web.Response:
        return json_response(self.body(), status=_CODES.get(self.status, 400))


def _invalid(message: str) -> _Refused:
    return _Refused("INVALID_ARGUMENT", message)


# --- validation ------------------------------------------------------------------------------------


def _camel_key(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def _camel(value: Any, children: Mapping[str, Any] | None = None) -> Any:
    """Proto JSON takes field names in lowerCamel or snake_case (google-genai sends some snake):
    rename a message's keys to lowerCamel, recursing only into message fields (`children`), never
    into free-form values (schemas, function arguments)."""
    if isinstance(value, list):
        return [_camel(v, children) for v in value]
    if not isinstance(value, Mapping):
        return value
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = _camel_key(str(key))
        sub = (children or {}).get(name)
        out[name] = _camel(item, sub) if sub is not None else item
    return out


_LEAF: dict[str, Any] = {}
_PART_SHAPE = {
    "inlineData": _LEAF,
    "fileData": _LEAF,
    "functionCall": _LEAF,
    "functionResponse": _LEAF,
    "videoMetadata": _LEAF,
}
_CONTENT_SHAPE = {"parts": _PART_SHAPE}
_REQUEST_SHAPE = {
    "contents": _CONTENT_SHAPE,
    "systemInstruction": _CONTENT_SHAPE,
    "tools": {"functionDeclarations": _LEAF},
    "toolConfig": {"functionCallingConfig": _LEAF},
    "generationConfig": {"thinkingConfig": _LEAF},
}


def _unknown(fields: Mapping[str, Any], known: set[str], where: str) -> None:
    for name in fields:
        if name not in known:
            raise _invalid(f"Invalid JSON payload received. Unknown name \"{name}\" at '{where}': Cannot find field.")


def _check_parts(parts: Any, where: str) -> None:
    if not isinstance(parts, list) or not parts:
        raise _invalid(f"{where}.parts: contents.parts must not be empty.")
    for j, part in enumerate(parts):
        at = f"{where}.parts[{j}]"
        if not isinstance(part, Mapping):
            raise _invalid(f"{at} must be an object")
        _unknown(part, _PART_DATA | _PART_META, at)
        data = [k for k in part if k in _PART_DATA]
        if len(data) != 1:
            raise _invalid(f"{at}: a part must set exactly one data field (got {data or 'none'})")
        if "inlineData" in part:
            inline = part["inlineData"]
            if not isinstance(inline, Mapping) or not inline.get("mimeType") or not inline.get("data"):
                raise _invalid(f"{at}.inlineData needs mimeType and data")
        if "functionCall" in part and not isinstance(part["functionCall"].get("name"), str):
            raise _invalid(f"{at}.functionCall.name is required")
        if "functionResponse" in part:
            response = part["functionResponse"]
            if not isinstance(response.get("name"), str) or not isinstance(response.get("response"), Mapping):
                raise _invalid(f"{at}.functionResponse needs a name and a response object")


def _validate(body: Any) -> None:
    if not isinstance(body, Mapping):
        raise _invalid("Invalid JSON payload received.")
    _unknown(body, _TOP_LEVEL, "")
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise _invalid("* GenerateContentRequest.contents: contents is not specified")
    for i, content in enumerate(contents):
        where = f"contents[{i}]"
        if not isinstance(content, Mapping):
            raise _invalid(f"{where} must be an object")
        if content.get("role", "user") not in ("user", "model"):
            raise _invalid("Please use a valid role: user, model.")
        _check_parts(content.get("parts"), where)
    system = body.get("systemInstruction")
    if system is not None:
        _check_parts(system.get("parts") if isinstance(system, Mapping) else None, "systemInstruction")
    for k, tool in enumerate(body.get("tools") or []):
        for declaration in (tool or {}).get("functionDeclarations") or []:
            if not isinstance(declaration.get("name"), str):
                raise _invalid(f"tools[{k}].functionDeclarations: name is required")
            if "parameters" in declaration and "parametersJsonSchema" in declaration:
                raise _invalid("parameters and parametersJsonSchema are mutually exclusive")
    mode = ((body.get("toolConfig") or {}).get("functionCallingConfig") or {}).get("mode", "AUTO")
    if mode not in ("AUTO", "ANY", "NONE", "VALIDATED", "MODE_UNSPECIFIED"):
        raise _invalid(f"Invalid value at 'tool_config.function_calling_config.mode' ({mode})")
    generation = body.get("generationConfig") or {}
    _unknown(generation, _GENERATION, "generation_config")
    if "responseJsonSchema" in generation:
        if "responseSchema" in generation:
            raise _invalid("responseSchema and responseJsonSchema cannot both be set")
        if generation.get("responseMimeType") != "application/json":
            raise _invalid("responseJsonSchema requires responseMimeType application/json")
    count = generation.get("candidateCount", 1)
    if not isinstance(count, int) or not 1 <= count <= 8:
        raise _invalid("candidateCount must be between 1 and 8")
    max_tokens = generation.get("maxOutputTokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise _invalid("max_output_tokens must be positive")
    thinking = generation.get("thinkingConfig") or {}
    _unknown(thinking, {"thinkingBudget", "includeThoughts", "thinkingLevel"}, "generation_config.thinking_config")
    budget = thinking.get("thinkingBudget")
    if budget is not None and (not isinstance(budget, int) or not (budget == -1 or 0 <= budget <= 24576)):
        raise _invalid("The thinking budget is out of range; supported values are -1 and 0 to 24576.")


# --- the answer ------------------------------------------------------------------------------------


def _part_tokens(part: Mapping[str, Any]) -> int:
    if "text" in part:
        return count_tokens(str(part["text"]))
    if "inlineData" in part or "fileData" in part:
        return IMAGE_TOKENS
    return count_tokens(orjson.dumps(part, option=orjson.OPT_SORT_KEYS))


def _prompt(body: Mapping[str, Any]) -> tuple[int, list[tuple[bytes, int, float]]]:
    """(prompt tokens, implicit-cache prefixes: system and tools, then each turn's end)."""
    head: list[Any] = [body.get("systemInstruction"), body.get("tools")]
    tokens = sum(_part_tokens(p) for p in (body.get("systemInstruction") or {}).get("parts") or [])
    tokens += count_tokens(orjson.dumps(body.get("tools"))) if body.get("tools") else 0
    points: list[tuple[bytes, int, float]] = []
    if tokens >= MIN_CACHE_TOKENS:  # a long system instruction and tool list are a prefix of their own
        points.append((PromptCache.digest(head), tokens, _IMPLICIT_TTL_S))
    prefix: list[Any] = list(head)
    for content in body["contents"]:
        prefix.append(content)
        tokens += sum(_part_tokens(p) for p in content["parts"])
        if tokens >= MIN_CACHE_TOKENS:
            points.append((PromptCache.digest(prefix), tokens, _IMPLICIT_TTL_S))
    return max(tokens, 1), points


def _example(schema: Any, talker: Talker, key: str) -> Any:
    if not isinstance(schema, Mapping):
        return None
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind or "").lower()
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        names = schema.get("required") or list(props)
        return {name: _example(props.get(name, {"type": "string"}), talker, key + name) for name in names}
    if kind == "array":
        return [_example(schema.get("items") or {"type": "string"}, talker, key + "[]")]
    if kind == "integer":
        return 1
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    return "".join(talker.words(key, 2)).strip()


@dataclass(slots=True)
class _Candidate:
    index: int
    thoughts: list[str]
    words: list[str]
    call: dict[str, Any] | None
    finish: str
    signature: str | None = None  # the call's thoughtSignature (thinking models sign their calls)

    @property
    def output_tokens(self) -> int:
        call = count_tokens(orjson.dumps(self.call)) if self.call else 0
        return len(self.words) + call

    def parts(self, include_thoughts: bool) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if self.thoughts and include_thoughts:
            parts.append({"text": "".join(self.thoughts), "thought": True})
        if self.words:
            parts.append({"text": "".join(self.words)})
        if self.call is not None:
            parts.append(self.call_part())
        return parts or [{"text": ""}]

    def call_part(self) -> dict[str, Any]:
        part: dict[str, Any] = {"functionCall": self.call}
        if self.signature:
            part["thoughtSignature"] = self.signature
        return part


def _function_call(body: Mapping[str, Any], talker: Talker, key: str) -> dict[str, Any] | None:
    declarations = [d for tool in body.get("tools") or [] for d in (tool or {}).get("functionDeclarations") or []]
    if not declarations:
        return None
    config = (body.get("toolConfig") or {}).get("functionCallingConfig") or {}
    mode = config.get("mode", "AUTO")
    allowed = config.get("allowedFunctionNames") or []
    if mode == "NONE":
        return None
    if mode not in ("ANY", "VALIDATED"):
        last = body["contents"][-1]
        if last.get("role", "user") != "user" or any("functionResponse" in p for p in last["parts"]):
            return None
    declaration = next((d for d in declarations if d["name"] in allowed), None) if allowed else declarations[0]
    if declaration is None:
        raise _invalid("allowedFunctionNames names no declared function")
    schema = declaration.get("parametersJsonSchema") or declaration.get("parameters") or {}
    return {"name": declaration["name"], "args": _example(schema, talker, key + declaration["name"]) or {}}


def _always_thinks(model: str) -> bool:
    """Gemini 3 models always think, and refuse a function call returned without its signature."""
    return model.rsplit("/", 1)[-1].startswith("gemini-3")


def _signature(cfg: StandinConfig, call: Mapping[str, Any]) -> str:
    key = cfg.api_key.encode() + b"/thought-signature"
    digest = hashlib.blake2b(orjson.dumps(call, option=orjson.OPT_SORT_KEYS), key=key[:64], digest_size=32)
    return base64.b64encode(digest.digest()).decode()


def _bytes(value: Any) -> bytes | None:
    """A proto `bytes` field as sent in JSON: base64, standard or URL-safe (google-genai sends the latter)."""
    if not isinstance(value, str):
        return None
    text = value.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4))
    except ValueError:
        return None


def _check_signatures(body: Mapping[str, Any], cfg: StandinConfig) -> None:
    for i, content in enumerate(body["contents"]):
        if content.get("role") != "model":
            continue
        for part in content["parts"]:
            if "functionCall" not in part:
                continue
            call = {k: v for k, v in part["functionCall"].items() if k != "id"}
            if _bytes(part.get("thoughtSignature")) != _bytes(_signature(cfg, call)):
                raise _invalid(
                    f"Function call `{call.get('name')}` in the {i + 1}. content block is missing a "
                    "`thought_signature` (or carries one that was not issued for it)."
                )


def _plan(body: Mapping[str, Any], cfg: StandinConfig, model: str) -> tuple[list[_Candidate], bool, int]:
    """(candidates, whether thoughts are shown, thought tokens per candidate)."""
    talker = Talker(cfg.seed)
    generation = body.get("generationConfig") or {}
    limit = int(generation.get("maxOutputTokens") or 8192)
    thinking = generation.get("thinkingConfig") or {}
    budget = int(thinking.get("thinkingBudget", -1 if _always_thinks(model) else 0))
    think = (budget != 0 and "thinkingConfig" in generation) or _always_thinks(model)
    include = bool(thinking.get("includeThoughts"))
    candidates: list[_Candidate] = []
    base = orjson.dumps(body["contents"], option=orjson.OPT_SORT_KEYS).decode()
    thought_tokens = 0
    for index in range(int(generation.get("candidateCount", 1))):
        key = f"{index}:{base}"
        thoughts: list[str] = []
        if think:
            count = max(cfg.max_output_tokens // 2, 1)
            if budget > 0:
                count = min(count, budget)
            thoughts = talker.words("think" + key, count)
            thought_tokens = len(thoughts)
        call = _function_call(body, talker, key)
        words: list[str] = []
        finish = "STOP"
        if call is None:
            schema = generation.get("responseJsonSchema") or generation.get("responseSchema")
            if generation.get("responseMimeType") == "application/json":
                text = orjson.dumps(_example(schema or {"type": "object"}, talker, key)).decode()
                words = [text[i : i + 4] for i in range(0, len(text), 4)]
            else:
                length = talker.length(key, limit, cfg.max_output_tokens)
                words = talker.words(key, length)
                if length >= limit:
                    finish = "MAX_TOKENS"
                text = ""
                for n, word in enumerate(words):
                    text += word
                    if any(s and s in text for s in generation.get("stopSequences") or []):
                        words = words[:n]
                        break
        signature = _signature(cfg, call) if call is not None and think else None
        candidates.append(_Candidate(index, thoughts, words, call, finish, signature))
    return candidates, include, thought_tokens


def _usage(prompt: int, cached: int, candidates: list[_Candidate], thoughts: int) -> dict[str, Any]:
    output = sum(c.output_tokens for c in candidates)
    thought_total = thoughts * len(candidates)
    usage: dict[str, Any] = {
        "promptTokenCount": prompt,
        "candidatesTokenCount": output,
        "totalTokenCount": prompt + output + thought_total,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}],
    }
    if cached:
        usage["cachedContentTokenCount"] = cached
        usage["cacheTokensDetails"] = [{"modality": "TEXT", "tokenCount": cached}]
    if thought_total:
        usage["thoughtsTokenCount"] = thought_total
    return usage


# --- handlers --------------------------------------------------------------------------------------


def _authenticate(request: web.Request, cfg: StandinConfig, vertex: bool) -> None:
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        if auth[7:] != cfg.api_key:
            raise _Refused("UNAUTHENTICATED", "Request had invalid authentication credentials.")
        return
    if vertex:
        raise _Refused("UNAUTHENTICATED", "Request is missing required authentication credential.")
    key = request.headers.get("x-goog-api-key") or request.query.get("key")
    if not key:
        raise _Refused(
            "PERMISSION_DENIED",
            "Method doesn't allow unregistered callers (callers without established identity). "
            "Please use API Key or other form of API consumer identity to call this API.",
        )
    if key != cfg.api_key:
        raise _Refused("INVALID_ARGUMENT", "API key not valid. Please pass a valid API key.")


def _now_rfc3339(offset_s: float = 0.0) -> str:
    at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_s)
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def _generate(request: web.Request) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    target = request.match_info["target"]
    model, _, method = target.rpartition(":")
    vertex = "project" in request.match_info
    if request.match_info["version"] not in _VERSIONS:
        return _Refused("NOT_FOUND", f"API version {request.match_info['version']!r} is not found.").response()
    if method not in ("generateContent", "streamGenerateContent") or not model:
        return _Refused("NOT_FOUND", f"Method {method!r} is not found for model {model!r}.").response()
    try:
        _authenticate(request, cfg, vertex)
        try:
            body = _camel(orjson.loads(await request.read()), _REQUEST_SHAPE)
        except orjson.JSONDecodeError as exc:
            raise _invalid("Invalid JSON payload received.") from exc
        _validate(body)
        if cfg.models and model.rsplit("/", 1)[-1] not in cfg.models:
            raise _Refused("NOT_FOUND", f"models/{model} is not found for API version {request.match_info['version']}.")
        fault = request.app[FAULTS].take()
        if fault is not None:
            raise _Refused(*_FAULTS.get(fault, ("INTERNAL", "An internal error has occurred.")))
        prompt, points = _prompt(body)
        cached = 0
        name = body.get("cachedContent")
        if name:
            entry = request.app[_CACHES].get(str(name))
            if entry is None or entry.expires <= time.monotonic():
                raise _Refused("PERMISSION_DENIED", f"CachedContent not found (or permission denied): {name}")
            prompt += entry.tokens
            cached = entry.tokens
        else:
            cached = request.app[_IMPLICIT].account(points).read_tokens
        if _always_thinks(model):
            _check_signatures(body, cfg)
        candidates, include, thoughts = _plan(body, cfg, model)
        limit = int((body.get("generationConfig") or {}).get("maxOutputTokens") or 8192)
        verdict = request.app[_LIMITER].admit(prompt + limit)
        if not verdict.allowed:
            retry = f"{max(int(verdict.retry_after_s + 0.999), 1)}s"
            raise _Refused(
                "RESOURCE_EXHAUSTED",
                "You exceeded your current quota, please check your plan and billing details.",
                [
                    {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": []},
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry},
                ],
            )
    except _Refused as refused:
        request.app[TALLY].refuse(model)
        return refused.response()

    response_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{time.monotonic_ns()}").hex[:22]
    output = sum(c.output_tokens for c in candidates) + thoughts * len(candidates)

    def record(output_tokens: int) -> None:
        request.app[TALLY].record(
            model,
            input_tokens=prompt,
            output_tokens=output_tokens,
            cache_read_tokens=cached,
            reasoning_tokens=min(thoughts * len(candidates), output_tokens),
        )

    latency = Latency(cfg.ttft_ms, cfg.tpot_ms)
    if method == "generateContent":
        if cfg.fail_after_tokens and output > cfg.fail_after_tokens:
            request.app[TALLY].refuse(model)
            return _Refused("INTERNAL", "An internal error has occurred.").response()
        await latency.whole(output)
        record(output)
        answer = {
            "candidates": [
                {"content": {"role": "model", "parts": c.parts(include)}, "finishReason": c.finish, "index": c.index}
                for c in candidates
            ],
            "usageMetadata": _usage(prompt, cached, candidates, thoughts),
            "modelVersion": model.rsplit("/", 1)[-1],
            "responseId": response_id,
        }
        return json_response(answer)

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    sent = 0

    async def send(payload: dict[str, Any]) -> None:
        await response.write(b"data: " + orjson.dumps(payload) + b"\r\n\r\n")

    async def token() -> bool:
        nonlocal sent
        await (latency.first_token() if sent == 0 else latency.next_token())
        sent += 1
        if cfg.fail_after_tokens and sent > cfg.fail_after_tokens:
            record(sent - 1)
            await send(_Refused("INTERNAL", "An internal error has occurred.").body())
            return False
        return True

    def chunk(candidate: _Candidate, parts: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
        entry: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": candidate.index}
        if finish:
            entry["finishReason"] = finish
        return {
            "candidates": [entry],
            "usageMetadata": {"promptTokenCount": prompt, "totalTokenCount": prompt},
            "modelVersion": model.rsplit("/", 1)[-1],
            "responseId": response_id,
        }

    for candidate in candidates:
        for word in candidate.thoughts:
            if not await token():
                return await _end(response)
            if include:
                await send(chunk(candidate, [{"text": word, "thought": True}]))
        for word in candidate.words:
            if not await token():
                return await _end(response)
            await send(chunk(candidate, [{"text": word}]))
        if candidate.call is not None:
            for _ in range(count_tokens(orjson.dumps(candidate.call))):
                if not await token():
                    return await _end(response)
            await send(chunk(candidate, [candidate.call_part()]))
        last = chunk(candidate, [{"text": ""}], candidate.finish)
        if candidate is candidates[-1]:
            last["usageMetadata"] = _usage(prompt, cached, candidates, thoughts)
        await send(last)
    record(output)
    return await _end(response)


async def _end(response: web.StreamResponse) -> web.StreamResponse:
    await response.write_eof()
    return response


async def _create_cache(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    try:
        _authenticate(request, cfg, "project" in request.match_info)
        body = _camel(orjson.loads(await request.read()), _REQUEST_SHAPE)
        model = str(body.get("model") or "")
        if not model:
            raise _invalid("model is required")
        contents = body.get("contents") or []
        for i, content in enumerate(contents):
            _check_parts(content.get("parts"), f"contents[{i}]")
        tokens = sum(_part_tokens(p) for c in contents for p in c.get("parts") or [])
        tokens += sum(_part_tokens(p) for p in (body.get("systemInstruction") or {}).get("parts") or [])
        if tokens < MIN_CACHE_TOKENS:
            raise _invalid(
                f"Cached content is too small. total_token_count={tokens}, min_total_token_count={MIN_CACHE_TOKENS}"
            )
        ttl = str(body.get("ttl") or "3600s")
        ttl_s = float(ttl.rstrip("s"))
    except (orjson.JSONDecodeError, ValueError, AttributeError):
        return _invalid("Invalid JSON payload received.").response()
    except _Refused as refused:
        return refused.response()
    name = "cachedContents/" + uuid.uuid4().hex[:16]
    created = _now_rfc3339()
    request.app[_CACHES][name] = _Cached(name, model, tokens, time.monotonic() + ttl_s, created)
    return json_response(_cache_body(request.app[_CACHES][name], ttl_s))


def _cache_body(entry: _Cached, ttl_s: float) -> dict[str, Any]:
    return {
        "name": entry.name,
        "model": entry.model,
        "createTime": entry.created,
        "updateTime": entry.created,
        "expireTime": _now_rfc3339(ttl_s),
        "usageMetadata": {"totalTokenCount": entry.tokens},
    }


async def _get_cache(request: web.Request) -> web.Response:
    name = "cachedContents/" + request.match_info["cache"]
    entry = request.app[_CACHES].get(name)
    if entry is None or entry.expires <= time.monotonic():
        return _Refused("NOT_FOUND", f"CachedContent not found: {name}").response()
    if request.method == "DELETE":
        del request.app[_CACHES][name]
        return json_response({})
    return json_response(_cache_body(entry, entry.expires - time.monotonic()))


def build_app(cfg: StandinConfig) -> web.Application:
    app = base_app("gemini", cfg)
    app[_LIMITER] = RateLimiter(cfg.rpm, cfg.tpm)
    app[_IMPLICIT] = PromptCache()
    app[_CACHES] = {}
    app.router.add_post("/{version}/models/{target}", _generate)
    vertex = "/{version}/projects/{project}/locations/{location}/publishers/google/models/{target}"
    app.router.add_post(vertex, _generate)
    app.router.add_post("/{version}/cachedContents", _create_cache)
    app.router.add_get("/{version}/cachedContents/{cache}", _get_cache)
    app.router.add_delete("/{version}/cachedContents/{cache}", _get_cache)
    return app

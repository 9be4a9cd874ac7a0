"""The gateway's own API as an OpenAPI 3.1 document, served at `GET /openapi.json`.

Hand-written on purpose: the document is a statement of what each route takes and who may call it,
checked against the router by tests/gateway/test_openapi.py (a route the document lacks, or a
documented route the code does not serve, fails the suite), so a new surface cannot arrive without
saying what it accepts. The chaos benchmark's schema-driven fuzz and per-surface checklist
(bench/chaos) walk every operation of this document, so whatever is documented is also probed.

Each operation carries tokenway's own extensions, which those probes read:

- `x-tokenway-surface`: which surface the route belongs to (inference, responses, files-batch,
  models, health, admin, console, meta): docs/security.md lists the checks each surface passes.
- `x-tokenway-auth`: `key` (an API key), `admin` (the admin token or a console session; without a
  token configured, direct loopback callers only), `metrics` (`telemetry.metrics.token` when set),
  `none`.
- `x-tokenway-ledger`: the route is an inference request and leaves exactly one ledger record.
- `x-tokenway-owned`: the path's id belongs to the key that made it (another key gets 404).

The document holds no secret and no configuration: it is the same for every gateway, and served
without credentials.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Final

import orjson
from aiohttp import web

from gateway import __version__
from gateway.batch.objects import COMPLETION_WINDOW, ENDPOINTS
from gateway.console.sessions import COOKIE, CSRF_HEADER

Schema = dict[str, Any]
OPENAPI_PATH: Final = "/openapi.json"
SURFACES: Final = ("inference", "responses", "files-batch", "models", "health", "admin", "console", "meta")
AUTH_KINDS: Final = ("key", "admin", "metrics", "none")


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(properties: dict[str, Schema], required: tuple[str, ...] = (), *, extra: bool = True) -> Schema:
    """An object schema; OpenAI-style bodies accept fields the gateway does not name (passed on to
    the engine, or dropped when they would steer it: docs/security.md), admin bodies do not."""
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": extra}
    if required:
        schema["required"] = list(required)
    return schema


_STR: Final[Schema] = {"type": "string"}
_INT: Final[Schema] = {"type": "integer"}
_NUM: Final[Schema] = {"type": "number"}
_BOOL: Final[Schema] = {"type": "boolean"}
_MODEL: Final[Schema] = {"type": "string", "minLength": 1, "maxLength": 256}
_METADATA: Final[Schema] = {
    "type": "object",
    "maxProperties": 16,
    "propertyNames": {"maxLength": 64},
    "additionalProperties": {"type": "string", "maxLength": 512},
}
_STOP: Final[Schema] = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]}
_TOKEN_IDS: Final[Schema] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
_LIMITS: Final[Schema] = _obj(
    {
        name: {"type": ["integer", "null"], "minimum": 0}
        for name in ("rpm", "rpd", "tpm", "tpd", "max_concurrent", "max_files", "max_bytes")
    }
    | {name: {"type": ["number", "null"], "minimum": 0} for name in ("usd_per_day", "usd_per_month")},
    extra=False,
)
_KEY_META: Final[Schema] = _obj({"owner": _STR, "team": _STR, "description": _STR}, extra=False)
_EXPIRY: Final[dict[str, Schema]] = {
    "expires_at": {"oneOf": [{"type": "string", "description": "an ISO 8601 time"}, {"type": "number"}]},
    "expires_in": {"type": "string", "pattern": "^[0-9]+[mhd]$", "description": "90m, 12h, 30d"},
}

SCHEMAS: Final[dict[str, Schema]] = {
    "Error": _obj(
        {
            "error": _obj(
                {
                    "message": _STR,
                    "type": _STR,
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                ("message", "type"),
            )
        },
        ("error",),
    ),
    "AnthropicError": _obj(
        {
            "type": {"const": "error"},
            "error": _obj({"type": _STR, "message": _STR}, ("type", "message")),
            "request_id": _STR,
        },
        ("type", "error"),
    ),
    "ChatMessage": _obj(
        {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"type": ["string", "array", "null"], "items": {"type": "object"}},
            "name": _STR,
            "tool_calls": {"type": "array", "items": {"type": "object"}},
            "tool_call_id": _STR,
        },
        ("role",),
    ),
    "ChatCompletionRequest": _obj(
        {
            "model": _MODEL,
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "max_tokens": {"type": ["integer", "null"], "minimum": 1},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
            "min_tokens": {"type": "integer", "minimum": 0},
            "ignore_eos": _BOOL,
            "n": {"type": "integer", "minimum": 1, "maximum": 128},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
            "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
            "logprobs": _BOOL,
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "stream": _BOOL,
            "stream_options": _obj({"include_usage": _BOOL}),
            "stop": _STOP,
            "seed": _INT,
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
            "response_format": _obj({"type": _STR, "json_schema": {"type": "object"}}),
            "user": _STR,
            "metadata": _METADATA,
        },
        ("model", "messages"),
    ),
    "CompletionRequest": _obj(
        {
            "model": _MODEL,
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}},
                    _TOKEN_IDS,
                    {"type": "array", "items": _TOKEN_IDS},
                ]
            },
            "max_tokens": {"type": ["integer", "null"], "minimum": 1},
            "min_tokens": {"type": "integer", "minimum": 0},
            "ignore_eos": _BOOL,
            "n": {"type": "integer", "minimum": 1, "maximum": 128},
            "best_of": {"type": "integer", "minimum": 1, "maximum": 20},
            "echo": _BOOL,
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "stream": _BOOL,
            "stream_options": _obj({"include_usage": _BOOL}),
            "stop": _STOP,
            "suffix": _STR,
            "seed": _INT,
            "user": _STR,
        },
        ("model", "prompt"),
    ),
    "EmbeddingRequest": _obj(
        {
            "model": _MODEL,
            "input": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}},
                    _TOKEN_IDS,
                    {"type": "array", "items": _TOKEN_IDS},
                ]
            },
            "dimensions": {"type": "integer", "minimum": 1},
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "user": _STR,
        },
        ("model", "input"),
    ),
    "ResponseRequest": _obj(
        {
            "model": _MODEL,
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "instructions": {"type": ["string", "null"]},
            "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
            "previous_response_id": {"type": ["string", "null"]},
            "store": _BOOL,
            "stream": _BOOL,
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
            "text": _obj({"format": {"type": "object"}}),
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "user": _STR,
            "metadata": _METADATA,
        },
        ("model", "input"),
    ),
    "AnthropicMessage": _obj(
        {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        },
        ("role", "content"),
    ),
    "MessagesRequest": _obj(
        {
            "model": _MODEL,
            "messages": {"type": "array", "minItems": 1, "items": _ref("AnthropicMessage")},
            "max_tokens": {"type": "integer", "minimum": 1},
            "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "stream": _BOOL,
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": _obj(
                {"type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": _STR}, ("type",)
            ),
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "stop_sequences": {"type": "array", "items": {"type": "string"}},
            "metadata": _obj({"user_id": _STR}),
        },
        ("model", "messages", "max_tokens"),
    ),
    "CountTokensRequest": _obj(
        {
            "model": _MODEL,
            "messages": {"type": "array", "minItems": 1, "items": _ref("AnthropicMessage")},
            "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "tools": {"type": "array", "items": {"type": "object"}},
        },
        ("model", "messages"),
    ),
    "FileUpload": _obj(
        {
            "file": {"type": "string", "contentMediaType": "application/octet-stream", "description": "JSONL"},
            "purpose": {"type": "string", "enum": ["batch"]},
            "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
            "expires_after[seconds]": {"type": "integer"},
        },
        ("file", "purpose"),
        extra=False,
    ),
    "BatchRequest": _obj(
        {
            "input_file_id": _STR,
            "endpoint": {"type": "string", "enum": list(ENDPOINTS)},
            "completion_window": {"const": COMPLETION_WINDOW},
            "metadata": {"oneOf": [_METADATA, {"type": "null"}]},
            "output_expires_after": _obj(
                {"anchor": {"type": "string", "enum": ["created_at"]}, "seconds": _INT}, ("anchor", "seconds")
            ),
        },
        ("input_file_id", "endpoint", "completion_window"),
    ),
    "KeyCreate": _obj(
        {
            "tenant": _STR,
            "id": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"},
            "models": {"type": "array", "items": _STR},
            "priority": _STR,
            "limits": _LIMITS,
            "metadata": _KEY_META,
            **_EXPIRY,
        },
        ("tenant",),
        extra=False,
    ),
    "KeyPatch": _obj(
        {
            "models": {"type": ["array", "null"], "items": _STR},
            "priority": {"type": ["string", "null"]},
            "limits": _LIMITS,
            "metadata": _KEY_META,
            **_EXPIRY,
        },
        extra=False,
    ),
    "KeyRotate": _obj({"grace_s": {"type": "number", "minimum": 0}}, extra=False),
    "TenantCreate": _obj(
        {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"},
            "models": {"type": "array", "items": _STR},
            "priority": _STR,
            "allow_fallback": _BOOL,
            "slo_class": {"type": ["string", "null"]},
            "limits": _LIMITS,
            "metadata": _KEY_META,
        },
        ("name",),
        extra=False,
    ),
    "TenantPatch": _obj(
        {
            "models": {"type": ["array", "null"], "items": _STR},
            "priority": {"type": ["string", "null"]},
            "allow_fallback": _BOOL,
            "slo_class": {"type": ["string", "null"]},
            "limits": _LIMITS,
            "metadata": _KEY_META,
        },
        extra=False,
    ),
    "Floor": _obj(
        {
            "min_replicas": {"type": "integer", "minimum": 0},
            "start_in_s": {"type": "number", "minimum": 0},
            "for_s": {"type": "number", "exclusiveMinimum": 0},
            "role": {"type": "string", "enum": ["prefill", "decode"]},
        },
        ("min_replicas", "for_s"),
        extra=False,
    ),
    "Login": _obj({"token": _STR}, extra=False),
    "List": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}}}, ("data",)),
    "Model": _obj({"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR}, ("id", "object")),
}

SECURITY_SCHEMES: Final[dict[str, Schema]] = {
    "apiKey": {"type": "http", "scheme": "bearer", "description": "an API key: `Authorization: Bearer KEY`"},
    "xApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "the same key, Anthropic's way"},
    "adminToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "server.admin_token. Without one configured, only direct loopback callers whose Host "
        "names the gateway get in (never through a proxy).",
    },
    "consoleSession": {
        "type": "apiKey",
        "in": "cookie",
        "name": COOKIE,
        "description": f"a console session (POST /ui/login); state-changing calls also need `{CSRF_HEADER}: 1` "
        "and a same-origin request",
    },
    "metricsToken": {"type": "http", "scheme": "bearer", "description": "telemetry.metrics.token, when set"},
}

_SECURITY: Final[dict[str, list[dict[str, list[str]]]]] = {
    "key": [{"apiKey": []}, {"xApiKey": []}],
    "admin": [{"adminToken": []}, {"consoleSession": []}],
    "metrics": [{"metricsToken": []}, {}],
    "none": [],
}

_ERRORS: Final[dict[str, str]] = {
    "400": "the request is malformed (the field is named in `param`)",
    "401": "missing or wrong credentials",
    "403": "refused: a cross-site or foreign-Host request, or a key that may not use this",
    "404": "no such route, model or object (another key's objects included)",
    "405": "method not allowed on this route",
    "408": "the request did not arrive within server.request_read_timeout_s",
    "409": "conflicts with what exists",
    "413": "the body is larger than the route's bound",
    "429": "a rate, concurrency or budget limit",
    "500": "the gateway failed (logged; `type: server_error`), never a plain-text page",
    "503": "the gateway or a store cannot serve it now: `overloaded` (the process-wide budget of request "
    "bodies being read, server.max_inflight_body_bytes, is full) or a store unavailable; retry after "
    "`Retry-After` seconds",
}
_SECONDS: Final[Schema] = {"schema": {"type": "integer", "minimum": 0}}
_HEADERS: Final[dict[str, Schema]] = {  # the headers an answer of that status carries
    "429": {
        "Retry-After": {**_SECONDS, "description": "seconds until the limit has room"},
        "x-ratelimit-limit-requests": {"schema": {"type": "string"}, "description": "the tightest request limit"},
        "x-ratelimit-remaining-requests": {"schema": {"type": "string"}, "description": "what is left of it"},
        "x-ratelimit-reset-requests": {"schema": {"type": "string"}, "description": "until it is whole (e.g. 20s)"},
    },
    "503": {"Retry-After": {**_SECONDS, "description": "seconds to wait before retrying"}},
}
RESPONSES: Final[dict[str, Schema]] = {
    f"{prefix}{code}": {
        "description": text + suffix,
        "content": {"application/json": {"schema": _ref(shape)}},
    }
    | ({"headers": _HEADERS[code]} if code in _HEADERS else {})
    for prefix, suffix, shape in (("E", "", "Error"), ("A", " (Anthropic's error shape)", "AnthropicError"))
    for code, text in _ERRORS.items()
}


def _json_body(schema: Schema, required: bool = True) -> Schema:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _path_param(name: str, description: str) -> Schema:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}, "description": description}


def _query(name: str, schema: Schema, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def _op(
    summary: str,
    surface: str,
    auth: str,
    *,
    body: Schema | None = None,
    params: tuple[Schema, ...] = (),
    ok: str = "200",
    ok_schema: Schema | None = None,
    ok_type: str = "application/json",
    errors: tuple[str, ...] = (),
    ledger: bool = False,
    owned: bool = False,
    anthropic: bool = False,
) -> Schema:
    """One operation: what it takes, who may call it, what it answers (errors in the route's shape).

    Every route may answer 400, 408, 413 (the body bounds hold for any request that sends a body)
    and 500 (`bounded_bodies` answers an unexpected failure in the route's shape); a route that takes
    a body may also answer 503 `overloaded` (the body budget); every Files and Batch call is one
    request against the key's rate limits (429)."""
    codes = {"400", "413", "408", "500", *errors}
    if body is not None:
        codes |= {"503"}
    if surface == "files-batch":
        codes |= {"429"}
    if auth != "none":
        codes |= {"401"}
    if auth in ("admin", "key"):
        codes |= {"403"}
    prefix = "A" if anthropic else "E"
    responses: Schema = {
        ok: {"description": "success", "content": {ok_type: {"schema": ok_schema or {"type": "object"}}}},
    }
    for code in sorted(codes):
        responses[code] = {"$ref": f"#/components/responses/{prefix}{code}"}
    operation: Schema = {
        "summary": summary,
        "tags": [surface],
        "security": _SECURITY[auth],
        "responses": responses,
        "x-tokenway-surface": surface,
        "x-tokenway-auth": auth,
    }
    if body is not None:
        operation["requestBody"] = body
    if params:
        operation["parameters"] = list(params)
    if ledger:
        operation["x-tokenway-ledger"] = True
    if owned:
        operation["x-tokenway-owned"] = True
    return operation


_KEY_ID = _path_param("key_id", "a key's id")
_TENANT = _path_param("name", "a tenant's name")
_POOL = _path_param("pool", "a pool's name")
_FILE_ID = _path_param("file_id", "a file id (file-...), the calling key's")
_BATCH_ID = _path_param("batch_id", "a batch id (batch_...), the calling key's")
_RESPONSE_ID = _path_param("response_id", "a stored response id (resp_...), the calling key's")
_PAGE = (
    _query("limit", {"type": "integer", "minimum": 1}, "how many"),
    _query("after", {"type": "string"}, "the id to list after"),
)
_INFERENCE = ("404", "429", "503")


def _paths() -> dict[str, dict[str, Schema]]:
    """Every route of `tokenway serve`, method by method (HEAD beside each GET is aiohttp's own)."""
    key, admin = "key", "admin"
    return {
        "/v1/chat/completions": {
            "post": _op(
                "Chat completion (OpenAI), streamed or not",
                "inference",
                key,
                body=_json_body(_ref("ChatCompletionRequest")),
                errors=_INFERENCE,
                ledger=True,
            )
        },
        "/v1/completions": {
            "post": _op(
                "Text completion (OpenAI)",
                "inference",
                key,
                body=_json_body(_ref("CompletionRequest")),
                errors=_INFERENCE,
                ledger=True,
            )
        },
        "/v1/embeddings": {
            "post": _op(
                "Embeddings (OpenAI)",
                "inference",
                key,
                body=_json_body(_ref("EmbeddingRequest")),
                errors=_INFERENCE,
                ledger=True,
            )
        },
        "/v1/responses": {
            "post": _op(
                "Create a response (OpenAI Responses); stored per key unless `store: false`",
                "responses",
                key,
                body=_json_body(_ref("ResponseRequest")),
                errors=_INFERENCE,
                ledger=True,
            )
        },
        "/v1/responses/{response_id}": {
            "get": _op("A stored response", "responses", key, params=(_RESPONSE_ID,), errors=("404",), owned=True),
            "delete": _op(
                "Delete a stored response", "responses", key, params=(_RESPONSE_ID,), errors=("404",), owned=True
            ),
        },
        "/v1/messages": {
            "post": _op(
                "Create a message (Anthropic Messages)",
                "inference",
                key,
                body=_json_body(_ref("MessagesRequest")),
                errors=_INFERENCE,
                ledger=True,
                anthropic=True,
            )
        },
        "/v1/messages/count_tokens": {
            "post": _op(
                "Count a message's input tokens (Anthropic)",
                "inference",
                key,
                body=_json_body(_ref("CountTokensRequest")),
                ok_schema=_obj({"input_tokens": _INT}, ("input_tokens",)),
                errors=("404", "429"),
                anthropic=True,
            )
        },
        "/v1/models": {"get": _op("The models the calling key may use", "models", key, ok_schema=_ref("List"))},
        "/v1/models/{model}": {
            "get": _op(
                "One model the calling key may use",
                "models",
                key,
                params=(_path_param("model", "a model or alias"),),
                ok_schema=_ref("Model"),
                errors=("404",),
            )
        },
        "/v1/key": {"get": _op("The calling key's limits, remaining buckets and spend", "models", key)},
        "/key/info": {"get": _op("The same as /v1/key (LiteLLM's path)", "models", key)},
        "/v1/files": {
            "post": _op(
                "Upload a batch input file (JSONL, multipart/form-data)",
                "files-batch",
                key,
                body={"required": True, "content": {"multipart/form-data": {"schema": _ref("FileUpload")}}},
                errors=("429", "503"),
            ),
            "get": _op(
                "The calling key's files",
                "files-batch",
                key,
                params=(*_PAGE, _query("purpose", _STR, "only files of this purpose")),
                ok_schema=_ref("List"),
            ),
        },
        "/v1/files/{file_id}": {
            "get": _op("A file's metadata", "files-batch", key, params=(_FILE_ID,), errors=("404",), owned=True),
            "delete": _op("Delete a file", "files-batch", key, params=(_FILE_ID,), errors=("404",), owned=True),
        },
        "/v1/files/{file_id}/content": {
            "get": _op(
                "A file's bytes",
                "files-batch",
                key,
                params=(_FILE_ID,),
                ok_type="application/octet-stream",
                ok_schema={"type": "string"},
                errors=("404",),
                owned=True,
            )
        },
        "/v1/batches": {
            "post": _op(
                "Create a batch over an uploaded file",
                "files-batch",
                key,
                body=_json_body(_ref("BatchRequest")),
                errors=("404", "429", "503"),
            ),
            "get": _op("The calling key's batches", "files-batch", key, params=_PAGE, ok_schema=_ref("List")),
        },
        "/v1/batches/{batch_id}": {
            "get": _op("A batch", "files-batch", key, params=(_BATCH_ID,), errors=("404",), owned=True)
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": _op("Cancel a batch", "files-batch", key, params=(_BATCH_ID,), errors=("404",), owned=True)
        },
        "/healthz": {"get": _op("The process is alive", "health", "none")},
        "/readyz": {"get": _op("Ready when the pools `server.ready_when` names can serve", "health", "none")},
        "/metrics": {
            "get": _op("Prometheus metrics", "health", "metrics", ok_type="text/plain", ok_schema={"type": "string"})
        },
        OPENAPI_PATH: {"get": _op("This document", "meta", "none")},
        "/admin/backends": {"get": _op("Pools and endpoints, with health and load", "admin", admin)},
        "/admin/status": {"get": _op("Admission, limits, policy reloads", "admin", admin)},
        "/admin/predictor": {"get": _op("The latency predictor's state", "admin", admin)},
        "/admin/predictor/samples": {"get": _op("The predictor's recent samples", "admin", admin)},
        "/admin/reload": {"post": _op("Reload policies.yaml now", "admin", admin)},
        "/admin/replicas": {"get": _op("Gateway replicas sharing state", "admin", admin)},
        "/admin/pools": {"get": _op("Pools, autoscaling and floors", "admin", admin)},
        "/admin/pools/{pool}/floor": {
            "get": _op("A pool's scheduled floors", "admin", admin, params=(_POOL,), errors=("404",)),
            "put": _op(
                "Schedule a floor of replicas",
                "admin",
                admin,
                params=(_POOL,),
                body=_json_body(_ref("Floor")),
                errors=("404", "409"),
            ),
            "delete": _op("Remove a pool's floors", "admin", admin, params=(_POOL,), errors=("404",)),
        },
        "/admin/keys": {
            "post": _op(
                "Create a key (the secret is answered once)",
                "admin",
                admin,
                body=_json_body(_ref("KeyCreate")),
                ok="201",
                errors=("404", "409", "503"),
            ),
            "get": _op(
                "Every key, never a secret",
                "admin",
                admin,
                params=(
                    _query("tenant", _STR, "only this tenant's keys"),
                    _query("include_revoked", _STR, "1 to list revoked keys too"),
                ),
                ok_schema=_ref("List"),
            ),
        },
        "/admin/keys/{key_id}": {
            "get": _op("A key and its standing", "admin", admin, params=(_KEY_ID,), errors=("404",)),
            "patch": _op(
                "Change a key",
                "admin",
                admin,
                params=(_KEY_ID,),
                body=_json_body(_ref("KeyPatch")),
                errors=("404", "409", "503"),
            ),
            "delete": _op("Revoke a key", "admin", admin, params=(_KEY_ID,), errors=("404", "409", "503")),
        },
        "/admin/keys/{key_id}/rotate": {
            "post": _op(
                "A new secret for a key (the old one ends after grace_s)",
                "admin",
                admin,
                params=(_KEY_ID,),
                body=_json_body(_ref("KeyRotate"), required=False),
                errors=("404", "409", "503"),
            )
        },
        "/admin/tenants": {
            "post": _op(
                "Create a tenant",
                "admin",
                admin,
                body=_json_body(_ref("TenantCreate")),
                ok="201",
                errors=("409", "503"),
            ),
            "get": _op("Every tenant", "admin", admin, ok_schema=_ref("List")),
        },
        "/admin/tenants/{name}": {
            "get": _op("A tenant and its keys", "admin", admin, params=(_TENANT,), errors=("404",)),
            "patch": _op(
                "Change a tenant",
                "admin",
                admin,
                params=(_TENANT,),
                body=_json_body(_ref("TenantPatch")),
                errors=("404", "409", "503"),
            ),
            "delete": _op(
                "Delete a tenant without live keys", "admin", admin, params=(_TENANT,), errors=("404", "409")
            ),
        },
        "/admin/activity": {
            "get": _op(
                "This replica's last hour and newest requests (the console)",
                "admin",
                admin,
                params=(_query("after", {"type": "integer"}, "newest requests after this sequence number"),),
            )
        },
        "/admin/usage": {
            "get": _op(
                "Spend and usage from the ledger (the console)",
                "admin",
                admin,
                params=(
                    _query("since", _STR, "24h, 7d or a time"),
                    _query("until", _STR, "a time"),
                    _query("by", _STR, "comma-separated: tenant, key, model"),
                ),
            )
        },
        "/ui": {"get": _op("The console's page", "console", "none", ok_type="text/html", ok_schema=_STR)},
        "/ui/": {"get": _op("The console's page", "console", "none", ok_type="text/html", ok_schema=_STR)},
        "/ui/static/{name}": {
            "get": _op(
                "A console asset",
                "console",
                "none",
                params=(_path_param("name", "an asset's file name"),),
                ok_type="text/javascript",
                ok_schema=_STR,
                errors=("404",),
            )
        },
        "/ui/session": {"get": _op("Whether this browser is logged in", "console", "none")},
        "/ui/login": {
            "post": _op(
                "The admin token (in the body) for a session cookie",
                "console",
                "none",
                body=_json_body(_ref("Login")),
                errors=("401", "403", "429"),
            )
        },
        "/ui/logout": {"post": _op("End this browser's session", "console", "none")},
    }


@cache
def document() -> Schema:
    """The whole OpenAPI 3.1 document (built once; the same for every gateway)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tokenway",
            "version": __version__,
            "summary": "A token-aware LLM API gateway: the OpenAI and Anthropic surfaces, files and batches, "
            "health, metrics, the admin API and the console.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "servers": [{"url": "/"}],
        "tags": [{"name": surface} for surface in SURFACES],
        "paths": _paths(),
        "components": {"schemas": SCHEMAS, "responses": RESPONSES, "securitySchemes": SECURITY_SCHEMES},
    }


@cache
def _document_bytes() -> bytes:
    return orjson.dumps(document())


def operations(doc: Schema | None = None) -> list[tuple[str, str, Schema]]:
    """(METHOD, path, operation) of every operation in the document."""
    found = doc or document()
    methods = ("get", "put", "post", "delete", "patch", "head", "options")
    return [
        (method.upper(), path, item[method])
        for path, item in found["paths"].items()
        for method in methods
        if method in item
    ]


def resolve(schema: Any, doc: Schema | None = None) -> Any:
    """`schema` with every local `$ref` replaced by what it names (the document's schemas have no
    cycles), for tools that take plain JSON Schema (the fuzzers' generators)."""
    found = doc or document()
    if isinstance(schema, dict):
        if "$ref" in schema:
            target: Any = found
            for part in schema["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            return resolve(target, found)
        return {k: resolve(v, found) for k, v in schema.items()}
    if isinstance(schema, list):
        return [resolve(v, found) for v in schema]
    return schema


async def openapi_json(request: web.Request) -> web.Response:
    """`GET /openapi.json`: no credentials needed, the document names no secret."""
    return web.Response(body=_document_bytes(), content_type="application/json")


def setup_openapi_route(app: web.Application) -> None:
    app.router.add_get(OPENAPI_PATH, openapi_json)

"""The building blocks of the OpenAPI document (gateway/http/openapi.py): component schemas, error
responses in both APIs' shapes, security schemes, and `op`, which states one operation with the
extensions the chaos probes read (`x-tokenway-surface`, `-auth`, `-ledger`, `-owned`).

Kept apart from the paths so that the list of routes reads as one table.
"""

from __future__ import annotations

from typing import Any, Final, get_args

from gateway.batch.objects import COMPLETION_WINDOW, ENDPOINTS
from gateway.console.sessions import COOKIE, CSRF_HEADER
from policies.keys.records import OverrideDimension

Schema = dict[str, Any]
OPENAPI_PATH: Final = "/openapi.json"
SURFACES: Final = ("inference", "responses", "files-batch", "models", "health", "admin", "console", "meta")
AUTH_KINDS: Final = ("key", "admin", "metrics", "none")


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(properties: dict[str, Schema], required: tuple[str, ...] = (), *, extra: bool = True) -> Schema:
    """An object schema; OpenAI-style bodies accept fields the gateway does not name (passed on to
    the engine, or dropped when they would steer it: docs/security.md), admin bodies do not."""
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": extra}
    if required:
        schema["required"] = list(required)
    return schema


STR: Final[Schema] = {"type": "string"}
INT: Final[Schema] = {"type": "integer"}
NUM: Final[Schema] = {"type": "number"}
BOOL: Final[Schema] = {"type": "boolean"}
MODEL: Final[Schema] = {"type": "string", "minLength": 1, "maxLength": 256}
METADATA: Final[Schema] = {
    "type": "object",
    "maxProperties": 16,
    "propertyNames": {"maxLength": 64},
    "additionalProperties": {"type": "string", "maxLength": 512},
}
STOP: Final[Schema] = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]}
TOKEN_IDS: Final[Schema] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
LIMITS: Final[Schema] = obj(
    {
        name: {"type": ["integer", "null"], "minimum": 0}
        for name in ("rpm", "rpd", "tpm", "tpd", "max_concurrent", "max_files", "max_bytes")
    }
    | {name: {"type": ["number", "null"], "minimum": 0} for name in ("usd_per_day", "usd_per_month")},
    extra=False,
)
KEY_META: Final[Schema] = obj({"owner": STR, "team": STR, "description": STR}, extra=False)
EXPIRY: Final[dict[str, Schema]] = {
    "expires_at": {"oneOf": [{"type": "string", "description": "an ISO 8601 time"}, {"type": "number"}]},
    "expires_in": {"type": "string", "pattern": "^[0-9]+[mhd]$", "description": "90m, 12h, 30d"},
}

SCHEMAS: Final[dict[str, Schema]] = {
    "Error": obj(
        {
            "error": obj(
                {
                    "message": STR,
                    "type": STR,
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                ("message", "type"),
            )
        },
        ("error",),
    ),
    "AnthropicError": obj(
        {
            "type": {"const": "error"},
            "error": obj({"type": STR, "message": STR}, ("type", "message")),
            "request_id": STR,
        },
        ("type", "error"),
    ),
    "ChatMessage": obj(
        {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"type": ["string", "array", "null"], "items": {"type": "object"}},
            "name": STR,
            "tool_calls": {"type": "array", "items": {"type": "object"}},
            "tool_call_id": STR,
        },
        ("role",),
    ),
    "ChatCompletionRequest": obj(
        {
            "model": MODEL,
            "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
            "max_tokens": {"type": ["integer", "null"], "minimum": 1},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
            "min_tokens": {"type": "integer", "minimum": 0},
            "ignore_eos": BOOL,
            "n": {"type": "integer", "minimum": 1, "maximum": 128},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
            "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
            "logprobs": BOOL,
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "stream": BOOL,
            "stream_options": obj({"include_usage": BOOL}),
            "stop": STOP,
            "seed": INT,
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
            "response_format": obj({"type": STR, "json_schema": {"type": "object"}}),
            "user": STR,
            "metadata": METADATA,
        },
        ("model", "messages"),
    ),
    "CompletionRequest": obj(
        {
            "model": MODEL,
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}},
                    TOKEN_IDS,
                    {"type": "array", "items": TOKEN_IDS},
                ]
            },
            "max_tokens": {"type": ["integer", "null"], "minimum": 1},
            "min_tokens": {"type": "integer", "minimum": 0},
            "ignore_eos": BOOL,
            "n": {"type": "integer", "minimum": 1, "maximum": 128},
            "best_of": {"type": "integer", "minimum": 1, "maximum": 20},
            "echo": BOOL,
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "stream": BOOL,
            "stream_options": obj({"include_usage": BOOL}),
            "stop": STOP,
            "suffix": STR,
            "seed": INT,
            "user": STR,
        },
        ("model", "prompt"),
    ),
    "EmbeddingRequest": obj(
        {
            "model": MODEL,
            "input": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}},
                    TOKEN_IDS,
                    {"type": "array", "items": TOKEN_IDS},
                ]
            },
            "dimensions": {"type": "integer", "minimum": 1},
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "user": STR,
        },
        ("model", "input"),
    ),
    "ResponseRequest": obj(
        {
            "model": MODEL,
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "instructions": {"type": ["string", "null"]},
            "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
            "previous_response_id": {"type": ["string", "null"]},
            "store": BOOL,
            "stream": BOOL,
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
            "text": obj({"format": {"type": "object"}}),
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "user": STR,
            "metadata": METADATA,
        },
        ("model", "input"),
    ),
    "AnthropicMessage": obj(
        {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        },
        ("role", "content"),
    ),
    "MessagesRequest": obj(
        {
            "model": MODEL,
            "messages": {"type": "array", "minItems": 1, "items": ref("AnthropicMessage")},
            "max_tokens": {"type": "integer", "minimum": 1},
            "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "stream": BOOL,
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": obj(
                {"type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": STR}, ("type",)
            ),
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "stop_sequences": {"type": "array", "items": {"type": "string"}},
            "metadata": obj({"user_id": STR}),
        },
        ("model", "messages", "max_tokens"),
    ),
    "CountTokensRequest": obj(
        {
            "model": MODEL,
            "messages": {"type": "array", "minItems": 1, "items": ref("AnthropicMessage")},
            "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "tools": {"type": "array", "items": {"type": "object"}},
        },
        ("model", "messages"),
    ),
    "FileUpload": obj(
        {
            "file": {"type": "string", "contentMediaType": "application/octet-stream", "description": "JSONL"},
            "purpose": {"type": "string", "enum": ["batch"]},
            "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
            "expires_after[seconds]": {"type": "integer"},
        },
        ("file", "purpose"),
        extra=False,
    ),
    "BatchRequest": obj(
        {
            "input_file_id": STR,
            "endpoint": {"type": "string", "enum": list(ENDPOINTS)},
            "completion_window": {"const": COMPLETION_WINDOW},
            "metadata": {"oneOf": [METADATA, {"type": "null"}]},
            "output_expires_after": obj(
                {"anchor": {"type": "string", "enum": ["created_at"]}, "seconds": INT}, ("anchor", "seconds")
            ),
        },
        ("input_file_id", "endpoint", "completion_window"),
    ),
    "KeyCreate": obj(
        {
            "tenant": STR,
            "id": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"},
            "models": {"type": "array", "items": STR},
            "priority": STR,
            "limits": LIMITS,
            "metadata": KEY_META,
            **EXPIRY,
        },
        ("tenant",),
        extra=False,
    ),
    "KeyPatch": obj(
        {
            "models": {"type": ["array", "null"], "items": STR},
            "priority": {"type": ["string", "null"]},
            "limits": LIMITS,
            "metadata": KEY_META,
            **EXPIRY,
        },
        extra=False,
    ),
    "KeyRotate": obj({"grace_s": {"type": "number", "minimum": 0}}, extra=False),
    "TenantCreate": obj(
        {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"},
            "models": {"type": "array", "items": STR},
            "priority": STR,
            "allow_fallback": BOOL,
            "slo_class": {"type": ["string", "null"]},
            "team": {"type": ["string", "null"]},
            "limits": LIMITS,
            "metadata": KEY_META,
        },
        ("name",),
        extra=False,
    ),
    "OverrideCreate": obj(
        {
            "rule": STR,
            "subject": {"type": ["string", "null"]},
            "dimension": {"enum": list(get_args(OverrideDimension))},
            "value": {"type": "number", "exclusiveMinimum": 0},
            "until": {"type": ["string", "number"]},
            "for": STR,
            "reason": {"type": ["string", "null"]},
        },
        ("rule", "dimension", "value"),
        extra=False,
    ),
    "TenantPatch": obj(
        {
            "models": {"type": ["array", "null"], "items": STR},
            "priority": {"type": ["string", "null"]},
            "allow_fallback": BOOL,
            "slo_class": {"type": ["string", "null"]},
            "team": {"type": ["string", "null"]},
            "limits": LIMITS,
            "metadata": KEY_META,
        },
        extra=False,
    ),
    "Floor": obj(
        {
            "min_replicas": {"type": "integer", "minimum": 0},
            "start_in_s": {"type": "number", "minimum": 0},
            "for_s": {"type": "number", "exclusiveMinimum": 0},
            "role": {"type": "string", "enum": ["prefill", "decode"]},
        },
        ("min_replicas", "for_s"),
        extra=False,
    ),
    "Login": obj({"token": STR}, extra=False),
    "List": obj({"object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}}}, ("data",)),
    "Model": obj({"id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR}, ("id", "object")),
}

SECURITY_SCHEMES: Final[dict[str, Schema]] = {
    "apiKey": {"type": "http", "scheme": "bearer", "description": "an API key: `Authorization: Bearer KEY`"},
    "xApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "the same key, Anthropic's way"},
    "adminToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "server.admin_token, or a user's token of server.users (its role: x-tokenway-role). "
        "Without an admin token configured, only direct loopback callers whose Host names the gateway get in "
        "(never through a proxy).",
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

SECURITY: Final[dict[str, list[dict[str, list[str]]]]] = {
    "key": [{"apiKey": []}, {"xApiKey": []}],
    "admin": [{"adminToken": []}, {"consoleSession": []}],
    "metrics": [{"metricsToken": []}, {}],
    "none": [],
}

ERRORS: Final[dict[str, str]] = {
    "400": "the request is malformed (the field is named in `param`)",
    "401": "missing or wrong credentials",
    "403": "refused: a cross-site or foreign-Host request, a key that may not use this, or an operator whose "
    "role may not (`role_forbidden`: docs/security.md#roles-and-user-tokens)",
    "404": "no such route, model or object (another key's objects included)",
    "405": "method not allowed on this route",
    "408": "the request did not arrive within server.request_read_timeout_s",
    "409": "conflicts with what exists",
    "413": "the body is larger than the route's bound",
    "429": "a rate, concurrency or budget limit",
    "500": "the gateway failed (logged; `type: server_error`), never a plain-text page",
    "502": "a service the gateway called for it failed (the OpenID Connect provider of a console sign-on)",
    "503": "the gateway or a store cannot serve it now: `overloaded` (the process-wide budget of request "
    "bodies being read, server.max_inflight_body_bytes, is full) or a store unavailable; retry after "
    "`Retry-After` seconds",
}
SECONDS: Final[Schema] = {"schema": {"type": "integer", "minimum": 0}}
HEADERS: Final[dict[str, Schema]] = {  # the headers an answer of that status carries
    "429": {
        "Retry-After": {**SECONDS, "description": "seconds until the limit has room"},
        "x-ratelimit-limit-requests": {"schema": {"type": "string"}, "description": "the tightest request limit"},
        "x-ratelimit-remaining-requests": {"schema": {"type": "string"}, "description": "what is left of it"},
        "x-ratelimit-reset-requests": {"schema": {"type": "string"}, "description": "until it is whole (e.g. 20s)"},
    },
    "503": {"Retry-After": {**SECONDS, "description": "seconds to wait before retrying"}},
}
RESPONSES: Final[dict[str, Schema]] = {
    f"{prefix}{code}": {
        "description": text + suffix,
        "content": {"application/json": {"schema": ref(shape)}},
    }
    | ({"headers": HEADERS[code]} if code in HEADERS else {})
    for prefix, suffix, shape in (("E", "", "Error"), ("A", " (Anthropic's error shape)", "AnthropicError"))
    for code, text in ERRORS.items()
}


def json_body(schema: Schema, required: bool = True) -> Schema:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def path_param(name: str, description: str) -> Schema:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}, "description": description}


def query(name: str, schema: Schema, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def op(
    summary: str,
    surface: str,
    auth: str,
    *,
    body: Schema | None = None,
    params: tuple[Schema, ...] = (),
    ok: str = "200",
    ok_schema: Schema | None = None,
    ok_type: str = "application/json",
    ok_also: tuple[str, ...] = (),
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
    for media in ok_also:  # another form of the same answer (`?format=csv`)
        responses[ok]["content"][media] = {"schema": {"type": "string"}}
    for code in sorted(codes):
        responses[code] = {"$ref": f"#/components/responses/{prefix}{code}"}
    operation: Schema = {
        "summary": summary,
        "tags": [surface],
        "security": SECURITY[auth],
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


KEY_ID = path_param("key_id", "a key's id")
TENANT = path_param("name", "a tenant's name")
POOL = path_param("pool", "a pool's name")
FILE_ID = path_param("file_id", "a file id (file-...), the calling key's")
BATCH_ID = path_param("batch_id", "a batch id (batch_...), the calling key's")
RESPONSE_ID = path_param("response_id", "a stored response id (resp_...), the calling key's")
PAGE = (
    query("limit", {"type": "integer", "minimum": 1}, "how many"),
    query("after", {"type": "string"}, "the id to list after"),
)
INFERENCE = ("404", "429", "503")

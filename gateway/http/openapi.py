"""The gateway's own API as an OpenAPI 3.1 document, served at `GET /openapi.json`.

Hand-written on purpose: the document is a statement of what each route takes and who may call it,
checked against the router by tests/gateway/test_openapi.py (a route the document lacks, or a
documented route the code does not serve, fails the suite), so a new surface cannot arrive without
saying what it accepts. The chaos benchmark's schema-driven fuzz and per-surface checklist
(bench/chaos) walk every operation of this document, so whatever is documented is also probed.

Each operation carries tokenway's own extensions, which those probes read:

- `x-tokenway-surface`: which surface the route belongs to (inference, responses, files-batch,
  models, health, admin, console, meta): docs/security.md lists the checks each surface passes.
- `x-tokenway-auth`: `key` (an API key), `admin` (the admin token, a user's token or a console session; without a
  token configured, direct loopback callers only), `metrics` (`telemetry.metrics.token` when set),
  `none`.
- `x-tokenway-role`: on admin operations, what the caller's role must allow: `read` (every role),
  `team` (an admin, or a team admin for its own teams' keys and tenants), `admin`.
- `x-tokenway-team-scope`: on admin reads, what a team admin reads there (`access.TEAM_READS`):
  `fleet` (nothing per tenant or key, as a viewer), `team` (its teams' rows only), `none` (refused).
- `x-tokenway-ledger`: the route is an inference request and leaves exactly one ledger record.
- `x-tokenway-owned`: the path's id belongs to the key that made it (another key gets 404).

The document holds no secret and no configuration: it is the same for every gateway, and served
without credentials.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import orjson
from aiohttp import web

from gateway import __version__
from gateway.http.access import Need, need_of, reach_of
from gateway.http.openapi_parts import (
    AUTH_KINDS,
    BATCH_ID,
    FILE_ID,
    INFERENCE,
    INT,
    KEY_ID,
    OPENAPI_PATH,
    PAGE,
    POOL,
    RESPONSE_ID,
    RESPONSES,
    SCHEMAS,
    SECURITY_SCHEMES,
    STR,
    SURFACES,
    TENANT,
    Schema,
    json_body,
    obj,
    op,
    path_param,
    query,
    ref,
)

__all__ = [
    "AUTH_KINDS",
    "OPENAPI_PATH",
    "SURFACES",
    "document",
    "openapi_json",
    "operations",
    "resolve",
    "setup_openapi_route",
]


def _paths() -> dict[str, dict[str, Schema]]:
    """Every route of `tokenway serve`, method by method (HEAD beside each GET is aiohttp's own)."""
    key, admin = "key", "admin"
    return {
        "/v1/chat/completions": {
            "post": op(
                "Chat completion (OpenAI), streamed or not",
                "inference",
                key,
                body=json_body(ref("ChatCompletionRequest")),
                errors=INFERENCE,
                ledger=True,
            )
        },
        "/v1/completions": {
            "post": op(
                "Text completion (OpenAI)",
                "inference",
                key,
                body=json_body(ref("CompletionRequest")),
                errors=INFERENCE,
                ledger=True,
            )
        },
        "/v1/embeddings": {
            "post": op(
                "Embeddings (OpenAI)",
                "inference",
                key,
                body=json_body(ref("EmbeddingRequest")),
                errors=INFERENCE,
                ledger=True,
            )
        },
        "/v1/responses": {
            "post": op(
                "Create a response (OpenAI Responses); stored per key unless `store: false`",
                "responses",
                key,
                body=json_body(ref("ResponseRequest")),
                errors=INFERENCE,
                ledger=True,
            )
        },
        "/v1/responses/{response_id}": {
            "get": op("A stored response", "responses", key, params=(RESPONSE_ID,), errors=("404",), owned=True),
            "delete": op(
                "Delete a stored response", "responses", key, params=(RESPONSE_ID,), errors=("404",), owned=True
            ),
        },
        "/v1/messages": {
            "post": op(
                "Create a message (Anthropic Messages)",
                "inference",
                key,
                body=json_body(ref("MessagesRequest")),
                errors=INFERENCE,
                ledger=True,
                anthropic=True,
            )
        },
        "/v1/messages/count_tokens": {
            "post": op(
                "Count a message's input tokens (Anthropic)",
                "inference",
                key,
                body=json_body(ref("CountTokensRequest")),
                ok_schema=obj({"input_tokens": INT}, ("input_tokens",)),
                errors=("404", "429"),
                anthropic=True,
            )
        },
        "/v1/models": {"get": op("The models the calling key may use", "models", key, ok_schema=ref("List"))},
        "/v1/models/{model}": {
            "get": op(
                "One model the calling key may use",
                "models",
                key,
                params=(path_param("model", "a model or alias"),),
                ok_schema=ref("Model"),
                errors=("404",),
            )
        },
        "/v1/key": {"get": op("The calling key's limits, remaining buckets and spend", "models", key)},
        "/key/info": {"get": op("The same as /v1/key (LiteLLM's path)", "models", key)},
        "/v1/programs/{program}/outcome": {
            "post": op(
                "Record how an agent program ended, once (cost per outcome: docs/agents.md)",
                "inference",
                key,
                body=json_body(
                    obj(
                        {"success": {"type": "boolean"}, "value": {"type": "number"}},
                        ("success",),
                        extra=False,
                    )
                ),
                params=(path_param("program", "the program id the requests named (docs/agents.md)"),),
                ok="201",
                errors=("409",),
            )
        },
        "/v1/files": {
            "post": op(
                "Upload a batch input file (JSONL, multipart/form-data)",
                "files-batch",
                key,
                body={"required": True, "content": {"multipart/form-data": {"schema": ref("FileUpload")}}},
                errors=("429", "503"),
            ),
            "get": op(
                "The calling key's files",
                "files-batch",
                key,
                params=(*PAGE, query("purpose", STR, "only files of this purpose")),
                ok_schema=ref("List"),
            ),
        },
        "/v1/files/{file_id}": {
            "get": op("A file's metadata", "files-batch", key, params=(FILE_ID,), errors=("404",), owned=True),
            "delete": op("Delete a file", "files-batch", key, params=(FILE_ID,), errors=("404",), owned=True),
        },
        "/v1/files/{file_id}/content": {
            "get": op(
                "A file's bytes",
                "files-batch",
                key,
                params=(FILE_ID,),
                ok_type="application/octet-stream",
                ok_schema={"type": "string"},
                errors=("404",),
                owned=True,
            )
        },
        "/v1/batches": {
            "post": op(
                "Create a batch over an uploaded file",
                "files-batch",
                key,
                body=json_body(ref("BatchRequest")),
                errors=("404", "429", "503"),
            ),
            "get": op("The calling key's batches", "files-batch", key, params=PAGE, ok_schema=ref("List")),
        },
        "/v1/batches/{batch_id}": {
            "get": op("A batch", "files-batch", key, params=(BATCH_ID,), errors=("404",), owned=True)
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": op("Cancel a batch", "files-batch", key, params=(BATCH_ID,), errors=("404",), owned=True)
        },
        "/healthz": {"get": op("The process is alive", "health", "none")},
        "/readyz": {"get": op("Ready when the pools `server.ready_when` names can serve", "health", "none")},
        "/metrics": {
            "get": op("Prometheus metrics", "health", "metrics", ok_type="text/plain", ok_schema={"type": "string"})
        },
        OPENAPI_PATH: {"get": op("This document", "meta", "none")},
        "/": {"get": op("A landing page: what this is, links", "meta", "none", ok_type="text/html", ok_schema=STR)},
        "/v1": {"get": op("The same landing page", "meta", "none", ok_type="text/html", ok_schema=STR)},
        "/admin/backends": {"get": op("Pools and endpoints, with health and load", "admin", admin)},
        "/admin/status": {"get": op("Admission, limits, policy reloads", "admin", admin)},
        "/admin/predictor": {"get": op("The latency predictor's state", "admin", admin)},
        "/admin/predictor/samples": {"get": op("The predictor's recent samples", "admin", admin)},
        "/admin/reload": {"post": op("Reload policies.yaml now", "admin", admin)},
        "/admin/replicas": {"get": op("Gateway replicas sharing state", "admin", admin)},
        "/admin/pools": {"get": op("Pools, autoscaling and floors", "admin", admin)},
        "/admin/pools/{pool}/floor": {
            "get": op("A pool's scheduled floors", "admin", admin, params=(POOL,), errors=("404",)),
            "put": op(
                "Schedule a floor of replicas",
                "admin",
                admin,
                params=(POOL,),
                body=json_body(ref("Floor")),
                errors=("404", "409"),
            ),
            "delete": op("Remove a pool's floors", "admin", admin, params=(POOL,), errors=("404",)),
        },
        "/admin/keys": {
            "post": op(
                "Create a key (the secret is answered once)",
                "admin",
                admin,
                body=json_body(ref("KeyCreate")),
                ok="201",
                errors=("404", "409", "503"),
            ),
            "get": op(
                "Every key, never a secret",
                "admin",
                admin,
                params=(
                    query("tenant", STR, "only this tenant's keys"),
                    query("include_revoked", STR, "1 to list revoked keys too"),
                    query("spend", STR, "1 to add each key's spend_usd {day, month} (one store read per key)"),
                ),
                ok_schema=ref("List"),
            ),
        },
        "/admin/keys/{key_id}": {
            "get": op("A key and its standing", "admin", admin, params=(KEY_ID,), errors=("404",)),
            "patch": op(
                "Change a key",
                "admin",
                admin,
                params=(KEY_ID,),
                body=json_body(ref("KeyPatch")),
                errors=("404", "409", "503"),
            ),
            "delete": op("Revoke a key", "admin", admin, params=(KEY_ID,), errors=("404", "409", "503")),
        },
        "/admin/keys/{key_id}/rotate": {
            "post": op(
                "A new secret for a key (the old one ends after grace_s)",
                "admin",
                admin,
                params=(KEY_ID,),
                body=json_body(ref("KeyRotate"), required=False),
                errors=("404", "409", "503"),
            )
        },
        "/admin/tenants": {
            "post": op(
                "Create a tenant",
                "admin",
                admin,
                body=json_body(ref("TenantCreate")),
                ok="201",
                errors=("409", "503"),
            ),
            "get": op(
                "Every tenant",
                "admin",
                admin,
                params=(
                    query(
                        "spend",
                        STR,
                        "1 to add spend_usd {day, month} (UTC) and spend_source: the tenant's own, summed from the "
                        "ledger (kept 30 s); the sum of its keys' counters when the ledger is off or unreadable",
                    ),
                ),
                ok_schema=ref("List"),
            ),
        },
        "/admin/tenants/{name}": {
            "get": op("A tenant and its keys", "admin", admin, params=(TENANT,), errors=("404",)),
            "patch": op(
                "Change a tenant",
                "admin",
                admin,
                params=(TENANT,),
                body=json_body(ref("TenantPatch")),
                errors=("404", "409", "503"),
            ),
            "delete": op("Delete a tenant without live keys", "admin", admin, params=(TENANT,), errors=("404", "409")),
        },
        "/admin/overrides": {
            "post": op(
                "Override a rule's limit or budget until a time",
                "admin",
                admin,
                body=json_body(ref("OverrideCreate")),
                ok="201",
                errors=("404", "409", "503"),
            ),
            "get": op(
                "The temporary overrides",
                "admin",
                admin,
                params=(query("include_ended", STR, "also those that ended (until deleted or replaced)"),),
                ok_schema=ref("List"),
            ),
        },
        "/admin/overrides/{override_id}": {
            "delete": op(
                "End an override now",
                "admin",
                admin,
                params=(path_param("override_id", "an override's id (ov-...)"),),
                errors=("404",),
            ),
        },
        "/admin/activity": {
            "get": op(
                "The last hour and newest requests (the console); a team admin's: its teams' counters",
                "admin",
                admin,
                params=(query("after", {"type": "integer"}, "newest requests after this sequence number"),),
            )
        },
        "/admin/usage": {
            "get": op(
                "Spend and usage from the ledger (the console)",
                "admin",
                admin,
                params=(
                    query("since", STR, "24h, 7d or a time"),
                    query("until", STR, "a time"),
                    query("by", STR, "comma-separated: tenant, key, model"),
                    query("format", {"type": "string", "enum": ["json", "csv"]}, "json (default) or csv: a download"),
                ),
                ok_also=("text/csv",),
            )
        },
        "/admin/programs": {
            "get": op(
                "Live agent runs (programs) and what each spent: calls, tokens, dollars, wall-clock cap, "
                "every run cap with what is left, from the runs' own counters; a run no run rule counts from "
                "the ledger (`source: ledger`, no caps) (the console)",
                "admin",
                admin,
                params=(
                    query("tenant", STR, "only this tenant's runs"),
                    query("sort", {"type": "string", "enum": ["spend", "recent"]}, "spend (default) or last call"),
                    query("limit", {"type": "integer", "minimum": 1, "maximum": 200}, "how many (default 50)"),
                ),
            )
        },
        "/admin/models/{model}/check": {
            "post": op(
                "Test a model: one max_tokens=1 chat request through the gateway, its outcome and latency",
                "admin",
                admin,
                params=(path_param("model", "a model (or alias) served here"),),
                errors=("404",),
            )
        },
        "/admin/adapters": {
            "get": op(
                "LoRA adapters per pool and replica: where each is, its size against the memory budget, "
                "loads, preloads, evictions and unloads (the console)",
                "admin",
                admin,
            )
        },
        "/admin/audit": {
            "get": op(
                "The audit log of admin changes, newest first (who, when, what, before and after)",
                "admin",
                admin,
                params=(
                    query("since", STR, "24h, 7d or a time: only changes since"),
                    query("actor", STR, "admin-token, loopback, console (every session) or console:<id>"),
                    query("action", STR, "a part of METHOD route, e.g. keys or DELETE /admin/keys"),
                    query("target", STR, "the changed object's id"),
                    query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "how many (default 100)"),
                ),
                ok_schema=ref("List"),
            )
        },
        "/ui": {"get": op("The console's page", "console", "none", ok_type="text/html", ok_schema=STR)},
        "/ui/": {"get": op("The console's page", "console", "none", ok_type="text/html", ok_schema=STR)},
        "/ui/static/{name}": {
            "get": op(
                "A console asset",
                "console",
                "none",
                params=(path_param("name", "an asset's file name"),),
                ok_type="text/javascript",
                ok_schema=STR,
                errors=("404",),
            )
        },
        "/ui/session": {"get": op("Whether this browser is logged in", "console", "none")},
        "/ui/login": {
            "post": op(
                "The admin token (in the body) for a session cookie",
                "console",
                "none",
                body=json_body(ref("Login")),
                errors=("401", "403", "429"),
            )
        },
        "/ui/logout": {"post": op("End this browser's session", "console", "none")},
        "/ui/oidc/login": {
            "get": op(
                "Single sign-on: redirect to the OpenID Connect provider (authorization code + PKCE)",
                "console",
                "none",
                ok="302",
                ok_type="text/plain",
                ok_schema=STR,
                errors=("403", "404", "502"),
            )
        },
        "/ui/oidc/callback": {
            "get": op(
                "Single sign-on: the provider's answer, verified, for a session cookie (redirects to /ui)",
                "console",
                "none",
                params=(
                    query("code", STR, "the authorization code"),
                    query("state", STR, "the login this gateway started"),
                ),
                ok="303",
                ok_type="text/plain",
                ok_schema=STR,
                errors=("403", "404", "502"),
            )
        },
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
        "paths": _with_roles(_paths()),
        "components": {"schemas": SCHEMAS, "responses": RESPONSES, "securitySchemes": SECURITY_SCHEMES},
    }


def _with_roles(paths: dict[str, dict[str, Schema]]) -> dict[str, dict[str, Schema]]:
    """Each admin operation with `x-tokenway-role`: what its caller's role must allow, read from the
    table the admin guard enforces (gateway/http/access.py), so the document cannot disagree with it."""
    for path, item in paths.items():
        for method, operation in item.items():
            if operation.get("x-tokenway-auth") == "admin":
                operation["x-tokenway-role"] = need_of(method, path).value
                if need_of(method, path) is Need.READ:
                    operation["x-tokenway-team-scope"] = reach_of(method, path).value
    return paths


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

"""The OpenAPI document against the code: every route the router serves is documented, every
documented route is served, the document is valid OpenAPI 3.1, and `GET /openapi.json` answers it
without credentials. A new route without its entry (or an entry left behind) fails here."""

from __future__ import annotations

import re

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from gateway.app.factory import create_app
from gateway.app.settings import GatewaySettings
from gateway.http.openapi import AUTH_KINDS, OPENAPI_PATH, SURFACES, document, openapi_json, operations, resolve


def _served(app: web.Application) -> set[tuple[str, str]]:
    """(METHOD, path template) of every route; the HEAD aiohttp adds beside each GET is left out
    (it is the GET without a body), and `{name:regex}` is written `{name}` as OpenAPI does."""
    routes: set[tuple[str, str]] = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = str(info.get("path") or info.get("formatter") or "")
        routes.add((route.method, re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path)))
    return {(m, p) for m, p in routes if not (m == "HEAD" and ("GET", p) in routes)}


def test_every_route_is_documented_and_every_documented_route_served() -> None:
    app = create_app(GatewaySettings())  # the default configuration; nothing starts until the app runs
    served = _served(app)
    documented = {(method, path) for method, path, _ in operations()}
    assert served - documented == set(), "routes the document lacks (add them to gateway/http/openapi.py)"
    assert documented - served == set(), "documented routes the gateway does not serve"


@pytest.mark.slow
def test_the_document_is_valid_openapi_3_1() -> None:
    doc = orjson.loads(orjson.dumps(document()))  # what is served, not the Python objects
    assert doc["openapi"].startswith("3.1.")
    validate(doc)  # raises on anything invalid
    broken = {**doc, "paths": {"/x": {"get": {"responses": {"200": {"description": 7}}}}}}
    with pytest.raises(OpenAPIValidationError):  # the validator does reject what is wrong
        validate(broken)


def test_every_operation_names_its_surface_auth_and_error_shapes() -> None:
    for method, path, op in operations():
        where = f"{method} {path}"
        assert op["x-tokenway-surface"] in SURFACES, where
        assert op["x-tokenway-auth"] in AUTH_KINDS, where
        assert "400" in op["responses"] and "413" in op["responses"], where
        if op["x-tokenway-auth"] != "none":
            assert op["security"], where
            assert "401" in op["responses"], where
        for param in re.findall(r"\{(\w+)\}", path):
            assert any(p["in"] == "path" and p["name"] == param for p in op.get("parameters", ())), where
        if op.get("x-tokenway-ledger"):
            assert op["x-tokenway-surface"] in ("inference", "responses"), where
    by_path = {(m, p): op for m, p, op in operations()}
    assert by_path[("POST", "/admin/keys")]["x-tokenway-auth"] == "admin"
    assert by_path[("POST", "/v1/chat/completions")]["x-tokenway-ledger"] is True
    assert by_path[("GET", "/v1/files/{file_id}/content")]["x-tokenway-owned"] is True
    messages = by_path[("POST", "/v1/messages")]["responses"]["400"]["$ref"]
    assert messages.endswith("/A400")  # Anthropic's error shape under /v1/messages


def test_the_body_bounds_and_failures_are_documented_on_every_route_they_hold_for() -> None:
    doc = document()
    for method, path, op in operations():
        where = f"{method} {path}"
        assert {"408", "413", "500"} <= set(op["responses"]), where
        if "requestBody" in op:  # a body being read holds the process-wide budget: 503 overloaded
            assert "503" in op["responses"], where
        if op["x-tokenway-surface"] == "files-batch":  # each call is one request of the key's RPM
            assert "429" in op["responses"], where
    for prefix in ("E", "A"):
        assert "Retry-After" in doc["components"]["responses"][f"{prefix}503"]["headers"]
        assert "Retry-After" in doc["components"]["responses"][f"{prefix}429"]["headers"]


def test_request_schemas_resolve_to_plain_json_schema() -> None:
    for _, _, op in operations():
        body = op.get("requestBody")
        if body is None:
            continue
        for media in body["content"].values():
            schema = resolve(media["schema"])
            assert "$ref" not in orjson.dumps(schema).decode()
            assert schema["type"] == "object"


async def test_openapi_json_is_served_without_credentials() -> None:
    app = create_app(GatewaySettings())
    request = make_mocked_request("GET", OPENAPI_PATH, app=app)
    response = await openapi_json(request)
    assert response.status == 200
    assert response.content_type == "application/json"
    assert isinstance(response.body, bytes)
    assert orjson.loads(response.body) == orjson.loads(orjson.dumps(document()))
    route = next(r for r in app.router.routes() if r.resource is not None and r.resource.canonical == OPENAPI_PATH)
    assert route.handler is openapi_json  # registered bare: no guard, no key needed

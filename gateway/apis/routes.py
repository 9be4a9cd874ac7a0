"""Routes of the agent-era APIs and the OpenAI-shaped answer for every unknown route.

`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `POST /v1/messages`,
`POST /v1/messages/count_tokens`, `GET /v1/models/{id}`; `not_found_middleware` turns aiohttp's
plain-text 404 / 405 into OpenAI's error shape with an `x-request-id` (Anthropic's under
/v1/messages), and a body that cannot be read (not the `Content-Encoding` it claims) into a 400 on
every route, whichever handler read it. `canonical_path_middleware` answers 400 to any path whose
raw form is not the one canonical form (dot segments, empty segments, backslashes, percent-encoded
dots or slashes), on every route: a route sees an id only as the client wrote it, never as a
normaliser rewrote it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from gateway.apis.messages import MessagesCall, anthropic_error, count_tokens
from gateway.apis.responses import ResponsesCall, delete_response, get_response
from gateway.apis.store import ResponseStore
from gateway.app import keys as appkeys
from gateway.errors import GatewayError, InvalidRequest, ModelNotFound, error_response
from gateway.http.routes import START_TIME
from gateway.request.intake import authenticate, request_id

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RESPONSE_STORE: web.AppKey[ResponseStore | None] = web.AppKey("response_store")


class RouteNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "unknown_url"


class NonCanonicalPath(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_path"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


def _request_id(request: web.Request) -> str:
    return request_id(request.headers)  # the walk's safe reader: never echoes undecodable or long ids


async def create_response(request: web.Request) -> web.StreamResponse:
    call = ResponsesCall(request.app[RESPONSE_STORE])
    response = await request.app[appkeys.DIRECTOR].handle(request, call)
    await call.finished()
    return response


async def create_message(request: web.Request) -> web.StreamResponse:
    return await request.app[appkeys.DIRECTOR].handle(request, MessagesCall())


async def _principal_or_error(request: web.Request, anthropic_shape: bool = False) -> web.Response | object:
    try:
        return authenticate(request, request.app[appkeys.POLICIES].current)
    except GatewayError as error:
        headers = [("x-request-id", _request_id(request))]
        if anthropic_shape:
            return anthropic_error(error, headers, headers[0][1])
        return error_response(error, headers)


async def stored_response(request: web.Request) -> web.StreamResponse:
    principal = await _principal_or_error(request)
    if isinstance(principal, web.Response):
        return principal
    store = request.app[RESPONSE_STORE]
    response_id = request.match_info["response_id"]
    if request.method == "DELETE":
        answer = await delete_response(store, principal, response_id)  # type: ignore[arg-type]
    else:
        answer = await get_response(store, principal, response_id)  # type: ignore[arg-type]
    answer.headers["x-request-id"] = _request_id(request)
    return answer


async def retrieve_model(request: web.Request) -> web.StreamResponse:
    """One model the calling key may use, in OpenAI's shape; anything else is `model_not_found`."""
    principal = await _principal_or_error(request)
    if isinstance(principal, web.Response):
        return principal
    policy = request.app[appkeys.POLICIES].current
    name = request.match_info["model"]
    model = policy.resolve_model(name)
    served = bool(request.app[appkeys.FLEET].pools_for_model(model))
    headers = {"x-request-id": _request_id(request)}
    if not served or not (principal.may_use(model) or principal.may_use(name)):  # type: ignore[attr-defined]
        error = ModelNotFound(f"The model '{name}' does not exist or you do not have access to it.", param="model")
        return error_response(error, headers.items())
    created = int(request.app[START_TIME]) if START_TIME in request.app else 0
    body = {"id": name, "object": "model", "created": created, "owned_by": "tokenway"}
    return web.json_response(body, headers=headers)


@web.middleware
async def not_found_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404 / 405 answers, in the API's error shape."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        error: GatewayError = RouteNotFound(f"Unknown request URL: {request.method} {request.path}.")
    except web.HTTPMethodNotAllowed as exc:
        error = MethodNotAllowed(
            f"{request.method} is not allowed on {request.path} (allowed: {', '.join(sorted(exc.allowed_methods))})."
        )
        error.headers.append(("Allow", ", ".join(sorted(exc.allowed_methods))))
    except RequestPayloadError as exc:  # the client's body, not the gateway: 400
        error = InvalidRequest(f"the request body could not be read: {str(exc).strip()}")
    request_id = _request_id(request)
    if request.path.startswith("/v1/messages"):
        return anthropic_error(error, [("x-request-id", request_id)], request_id)
    return error_response(error, [("x-request-id", request_id)])


# Percent-encoded bytes a canonical path never holds: an unreserved dot (RFC 3986 keeps those
# unencoded), slashes and backslashes (a path's structure is its raw slashes), NUL.
_ENCODED = ("%2e", "%2f", "%5c", "%00")
# Model names may hold a slash ("org/model"): that route takes it percent-encoded.
_SLASHED_IDS = "/v1/models/"


def path_problem(raw_path: str) -> str | None:
    """Why the raw request target's path is not canonical, or None when it is."""
    path = raw_path.partition("?")[0].partition("#")[0]
    if not path.startswith("/"):
        return "the request path must be absolute"
    if "//" in path:
        return "the request path holds an empty segment ('//')"
    if "\\" in path:
        return "the request path holds a backslash"
    if "/." in path and any(segment in (".", "..") for segment in path.split("/")):
        return "the request path holds a '.' or '..' segment"
    if "%" in path:
        lowered = path.lower()
        for encoded in _ENCODED:
            if encoded in lowered:
                if encoded in ("%2f", "%5c") and lowered.startswith(_SLASHED_IDS) and lowered.count("/") == 3:
                    continue
                return f"the request path holds a percent-encoded {encoded!r}"
    return None


@web.middleware
async def canonical_path_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A 400 for a path that is not in its canonical form, before any route (or normaliser) sees it."""
    raw = request.raw_path
    if "//" not in raw and "\\" not in raw and "/." not in raw and "%" not in raw:
        return await handler(request)  # the common case: nothing to look at
    problem = path_problem(raw)
    if problem is None:
        return await handler(request)
    error = NonCanonicalPath(f"{problem}: send each path in its one canonical form.")
    request_id = _request_id(request)
    if request.path.startswith("/v1/messages"):
        return anthropic_error(error, [("x-request-id", request_id)], request_id)
    return error_response(error, [("x-request-id", request_id)])


def setup_api_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", stored_response)
    app.router.add_delete("/v1/responses/{response_id}", stored_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models/{model}", retrieve_model)

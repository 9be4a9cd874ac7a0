"""Routes of the agent-era APIs and the OpenAI-shaped answer for every unknown route.

`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `POST /v1/messages`,
`POST /v1/messages/count_tokens`, `GET /v1/models/{id}`; `not_found_middleware` turns aiohttp's
plain-text 404 / 405 into OpenAI's error shape with an `x-request-id` (Anthropic's under
/v1/messages), and a body that cannot be read (not the `Content-Encoding` it claims) into a 400 on
every route, whichever handler read it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from gateway import appkeys
from gateway.apis.messages import MessagesCall, anthropic_error, translate
from gateway.apis.responses import ResponsesCall, delete_response, get_response
from gateway.apis.store import ResponseStore
from gateway.errors import GatewayError, InvalidRequest, ModelNotFound, error_response
from gateway.request.intake import authenticate, request_id
from gateway.routes import START_TIME

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RESPONSE_STORE: web.AppKey[ResponseStore | None] = web.AppKey("response_store")


class RouteNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "unknown_url"


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


async def count_tokens(request: web.Request) -> web.StreamResponse:
    request_id = _request_id(request)
    headers = [("x-request-id", request_id)]
    principal = await _principal_or_error(request, anthropic_shape=True)
    if isinstance(principal, web.Response):
        return principal
    policy = request.app[appkeys.POLICIES].current
    estimator = request.app[appkeys.DIRECTOR].intake.estimator
    try:
        raw = await request.read()
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
        chat = translate(parsed, count_only=True)
        model = policy.resolve_model(str(parsed.get("model")))
        if not request.app[appkeys.FLEET].pools_for_model(model):
            raise ModelNotFound(
                f"The model '{parsed.get('model')}' does not exist or is not served here.", param="model"
            )
        tokens, _ids = await estimator.chat(chat["messages"], chat.get("tools"))
    except GatewayError as error:
        return anthropic_error(error, headers, request_id)
    return web.json_response({"input_tokens": tokens}, headers=dict(headers))


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


def setup_api_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", stored_response)
    app.router.add_delete("/v1/responses/{response_id}", stored_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models/{model}", retrieve_model)

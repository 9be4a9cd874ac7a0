"""Routes of the agent-era APIs.

`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `POST /v1/messages`,
`POST /v1/messages/count_tokens`, `GET /v1/models/{id}`. The answers for unknown routes and
non-canonical paths, on every route, are the app's middleware chain (`gateway/app/factory.py`).
"""

from __future__ import annotations

from aiohttp import web

from gateway.apis.messages import MessagesCall, anthropic_error, count_tokens
from gateway.apis.responses import ResponsesCall, delete_response, get_response
from gateway.apis.store import ResponseStore
from gateway.app import keys as appkeys
from gateway.errors import GatewayError, ModelNotFound, error_response
from gateway.http.routes import START_TIME
from gateway.request.intake import authenticate, request_id

RESPONSE_STORE: web.AppKey[ResponseStore | None] = web.AppKey("response_store")


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
    try:
        if request.method == "DELETE":
            answer = await delete_response(store, principal, response_id)  # type: ignore[arg-type]
        else:
            answer = await get_response(store, principal, response_id)  # type: ignore[arg-type]
    except GatewayError as error:  # the shared store did not answer (`StoreUnavailable`)
        answer = error_response(error)
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


def setup_api_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", stored_response)
    app.router.add_delete("/v1/responses/{response_id}", stored_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models/{model}", retrieve_model)

"""The simulated engine's Responses and Anthropic Messages routes, as `vllm serve` has them:
POST /v1/responses, GET /v1/responses/{id}, POST /v1/messages, POST /v1/messages/count_tokens.

Both run as chat requests (`backends.protocols` translates the body; `generation.py` runs it and
re-encodes the answer or the stream), so a prompt costs the same ids, and hits the same prefix
cache, through any of the three APIs. Stored responses (`store`, default true; vLLM keeps them
when its responses store is enabled) live in a small bounded map per engine, enough for
`previous_response_id` against the engine alone; the gateway keeps its own store and sends the
whole conversation instead.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from aiohttp import web

from backends.protocols import anthropic, responses
from backends.protocols.errors import ProtocolError
from sim import generation, prompt_cache, validation
from sim.engine import SimEngine
from sim.lora import adapter_names
from sim.request import new_id
from sim.validation import BadRequest

MAX_STORED_RESPONSES = 1024
_STORE: web.AppKey[OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]]] = web.AppKey("responses_store")
_ENGINE: web.AppKey[SimEngine] = web.AppKey("agent_engine")


def add_routes(app: web.Application, engine: SimEngine) -> None:
    app[_ENGINE] = engine
    app[_STORE] = OrderedDict()
    app.router.add_post("/v1/responses", _create_response)
    app.router.add_get("/v1/responses/{response_id}", _get_response)
    app.router.add_post("/v1/messages", _create_message)
    app.router.add_post("/v1/messages/count_tokens", _count_tokens)


def _translate(call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        result: dict[str, Any] = call(*args, **kwargs)
    except ProtocolError as exc:
        raise BadRequest(exc.message, exc.param) from None
    return result


def _salted(chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The translated chat body with the request's prefix-cache salt (vLLM's `cache_salt`, which its
    Responses and Messages routes take as its chat route does): the translation keeps only the API's
    own fields."""
    if "cache_salt" in body:
        chat["cache_salt"] = body["cache_salt"]
    return chat


def _model_name(body: dict[str, Any], engine: SimEngine) -> str:
    validation.check_common({"model": body.get("model")}, engine.config, adapter_names(engine.lora))
    return str(body.get("model") or engine.config.served_model_name)


async def _create_response(request: web.Request) -> web.StreamResponse:
    body = await validation.read_json(request)
    engine = request.app[_ENGINE]
    store = request.app[_STORE]
    model = _model_name(body, engine)
    prior: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        found = store.get(str(previous))
        if found is None:
            raise BadRequest(f"Response with id '{previous}' not found.", "previous_response_id", status=404)
        prior = [*found[0], *found[1].get("output", ())]
    chat = _salted(_translate(responses.to_chat, body, prior), body)
    prompt_ids = prompt_cache.chat_prompt_ids(chat["messages"], chat.get("tools"))
    response_id = f"resp_{request.headers.get('X-Request-Id') or new_id()}"
    history = [*prior, *responses.input_items(body.get("input"))]

    def keep(result: dict[str, Any]) -> None:
        if body.get("store", True) is not False:
            store[response_id] = (history, result)
            while len(store) > MAX_STORED_RESPONSES:
                store.popitem(last=False)

    return await generation.generate(
        request,
        engine,
        chat,
        prompt_ids,
        api="responses",
        response_id=response_id,
        model_name=model,
        original=body,
        on_result=keep,
    )


async def _get_response(request: web.Request) -> web.Response:
    found = request.app[_STORE].get(request.match_info["response_id"])
    if found is None:
        raise BadRequest(f"Response with id '{request.match_info['response_id']}' not found.", "response_id", 404)
    return web.json_response(found[1])


async def _create_message(request: web.Request) -> web.StreamResponse:
    body = await validation.read_json(request)
    engine = request.app[_ENGINE]
    model = _model_name(body, engine)
    chat = _salted(_translate(anthropic.to_chat, body), body)
    prompt_ids = prompt_cache.chat_prompt_ids(chat["messages"], chat.get("tools"))
    message_id = f"msg_{request.headers.get('X-Request-Id') or new_id()}"
    return await generation.generate(
        request, engine, chat, prompt_ids, api="messages", response_id=message_id, model_name=model, original=body
    )


async def _count_tokens(request: web.Request) -> web.Response:
    body = await validation.read_json(request)
    engine = request.app[_ENGINE]
    _model_name(body, engine)
    chat = _translate(anthropic.to_chat, body, count_only=True)
    prompt_ids = prompt_cache.chat_prompt_ids(chat["messages"], chat.get("tools"))
    return web.json_response(anthropic.count_tokens_body(len(prompt_ids)))

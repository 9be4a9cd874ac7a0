"""The OpenAI-compatible HTTP surface of one simulated engine, shaped like `vllm serve`'s.

Routes: POST /v1/chat/completions, /v1/completions (stream or not), GET /health, /ping, /version,
/v1/models, /metrics, /load, POST /tokenize, /detokenize, and two internal ones: POST
/internal/kv_pull (the PD side channel a decode instance calls) and POST /reset_prefix_cache
(vLLM's dev-mode route; emits AllBlocksCleared). `--api-key` guards /v1/* only, with vLLM's bare
401 body. Every response carries ``x-tokenway-sim: 1``.

A client that disconnects cancels its handler (aiohttp ``handler_cancellation``); the handler then
aborts the request in the engine, which frees its blocks at once and counts it as ``abort``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from backends import tokenization
from backends.sim import text_gen
from backends.sim.config import VLLM_VERSION, EngineConfig
from backends.sim.engine import SimEngine
from backends.sim.request import Request

ENGINE_KEY = web.AppKey("engine", SimEngine)
CREATED_KEY = web.AppKey("created", int)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(exc.status, exc.message, exc.param)


def _auth_middleware(api_key: str) -> Middleware:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _json({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return authenticate


async def _mark_sim(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-tokenway-sim"] = "1"


def build_app(engine: SimEngine) -> web.Application:
    config = engine.config
    middlewares: list[Middleware] = [_errors]
    if config.api_key:
        middlewares.insert(0, _auth_middleware(config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app[CREATED_KEY] = int(time.time())
    app.on_response_prepare.append(_mark_sim)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/ping", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/load", _load)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_post("/internal/kv_pull", _kv_pull)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    return app


# --- small routes --------------------------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE_KEY].alive else 503)


async def _version(_request: web.Request) -> web.Response:
    return _json({"version": VLLM_VERSION})


async def _models(request: web.Request) -> web.Response:
    config = request.app[ENGINE_KEY].config
    created = request.app[CREATED_KEY]
    data: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
            "max_model_len": config.max_model_len,
            "permission": [],
        }
        for name in config.served_model_names
    ]
    return _json({"object": "list", "data": data})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _load(request: web.Request) -> web.Response:
    s = request.app[ENGINE_KEY].scheduler
    return _json({"server_load": len(s.running) + s.num_waiting})


async def _read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    return body


async def _tokenize(request: web.Request) -> web.Response:
    body = await _read_json(request)
    config = request.app[ENGINE_KEY].config
    if "messages" in body:
        ids = tokenization.chat_prompt_ids(_messages(body), body.get("tools"))
    elif "prompt" in body:
        ids = tokenization.completion_prompt_ids(_single_prompt(body["prompt"]))
    else:
        raise BadRequest("Either 'prompt' or 'messages' is required", "prompt")
    return _json({"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids,
                  "token_strs": None})


async def _detokenize(request: web.Request) -> web.Response:
    body = await _read_json(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    return _json({"prompt": tokenization.decode(tokens)})


async def _kv_pull(request: web.Request) -> web.Response:
    body = await _read_json(request)
    engine = request.app[ENGINE_KEY]
    req = engine.release_pin(str(body.get("remote_request_id", "")), body.get("remote_engine_id"))
    if req is None:
        raise BadRequest("unknown or expired remote request", "remote_request_id", status=404)
    return _json({"num_tokens": req.num_prompt, "block_size": engine.config.block_size,
                  "engine_id": engine.config.engine_id})


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    ok = request.app[ENGINE_KEY].reset_prefix_cache()
    return web.Response(status=200 if ok else 409)


# --- generation ----------------------------------------------------------------------------------


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise BadRequest("each message must be an object", "messages")
    return messages


def _single_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return _single_prompt(prompt[0])
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)", "prompt")


def _int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"'{name}' must be an integer", name)
        if value < (0 if name.startswith("min") else 1):
            raise BadRequest(f"'{name}' must be at least {0 if name.startswith('min') else 1}", name)
        return value
    return None


def _check_common(body: dict[str, Any], config: EngineConfig) -> None:
    model = body.get("model")
    if model is not None and model not in config.served_model_names and model != config.model:
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("the simulated engine supports only n=1", "n")


def _check_length(prompt_len: int, max_tokens: int | None, config: EngineConfig) -> None:
    limit = config.max_model_len
    if prompt_len >= limit:
        raise BadRequest(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            "messages",
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise BadRequest(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {limit} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {limit} - {prompt_len}).",
            "max_tokens",
        )


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request)
    engine = request.app[ENGINE_KEY]
    _check_common(body, engine.config)
    prompt_ids = tokenization.chat_prompt_ids(_messages(body), body.get("tools"))
    return await _generate(request, engine, body, prompt_ids, chat=True)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request)
    engine = request.app[ENGINE_KEY]
    _check_common(body, engine.config)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", "prompt")
    prompt_ids = tokenization.completion_prompt_ids(_single_prompt(body["prompt"]))
    return await _generate(request, engine, body, prompt_ids, chat=False)


async def _generate(
    request: web.Request, engine: SimEngine, body: dict[str, Any], prompt_ids: list[int], chat: bool
) -> web.StreamResponse:
    config = engine.config
    max_tokens = _int_field(body, "max_completion_tokens", "max_tokens") if chat else _int_field(
        body, "max_tokens"
    )
    min_tokens = _int_field(body, "min_tokens") or 0
    _check_length(len(prompt_ids), max_tokens, config)
    needed_blocks = -(-(len(prompt_ids) + 1) // config.block_size)
    if needed_blocks > config.num_gpu_blocks:
        raise BadRequest(f"the prompt needs {needed_blocks} KV blocks; the engine has "
                         f"{config.num_gpu_blocks}", "messages" if chat else "prompt")
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise BadRequest("'kv_transfer_params' must be an object", "kv_transfer_params")
    salt = body.get("cache_salt")
    req = engine.create_request(
        prompt_ids,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        cache_salt=str(salt) if salt else None,
        kv_transfer_params=params,
    )
    changed = asyncio.Event()
    req.notify = changed.set
    base_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
    model_name = str(body.get("model") or config.served_model_name)
    created = int(time.time())
    engine.submit(req)
    try:
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return await _stream(request, engine, req, changed, response_id, model_name, created, chat,
                                 bool(options.get("include_usage")))
        while not req.finished:
            await changed.wait()
            changed.clear()
        text = text_gen.render(req.output_ids[: req.num_output])
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": req.finish_reason,
                                  "stop_reason": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None,
                                 "tool_calls": [], "reasoning_content": None}
        else:
            choice["text"] = text
        result: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": [choice],
            "usage": _usage(req),
            "prompt_logprobs": None,
            "kv_transfer_params": engine.kv_transfer_params(req) if req.remote_decode else None,
            "metrics": req.timings(),
        }
        return _json(result)
    finally:
        if not req.finished:
            engine.abort(req)


def _usage(req: Request) -> dict[str, Any]:
    return {
        "prompt_tokens": req.num_prompt,
        "completion_tokens": req.num_output,
        "total_tokens": req.num_prompt + req.num_output,
        "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens or 0},
    }


async def _stream(
    request: web.Request,
    engine: SimEngine,
    req: Request,
    changed: asyncio.Event,
    response_id: str,
    model_name: str,
    created: int,
    chat: bool,
    include_usage: bool,
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    base = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model_name}

    def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None and not role:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        return {**base, "choices": [choice]}

    async def send(data: dict[str, Any]) -> None:
        await response.write(b"data: " + orjson.dumps(data) + b"\n\n")

    if chat:
        await send(chunk(None, None, role=True))
    sent = 0
    while True:
        if req.num_output == sent and not req.finished:
            await changed.wait()
        changed.clear()
        produced = req.num_output
        done = req.finished
        if produced > sent or done:
            text = text_gen.render(req.output_ids[sent:produced])
            sent = produced
            data = chunk(text, req.finish_reason if done else None)
            if done:
                data["metrics"] = req.timings()
                if req.remote_decode:
                    data["kv_transfer_params"] = engine.kv_transfer_params(req)
            await send(data)
        if done:
            break
    if include_usage:
        await send({**base, "choices": [], "usage": _usage(req), "metrics": req.timings()})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response

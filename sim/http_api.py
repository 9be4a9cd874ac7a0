"""The HTTP surface of one simulated engine, shaped like `vllm serve`'s: the OpenAI-compatible routes,
the Responses and Anthropic Messages routes, and the vectors `/v1/embeddings` answers.

Routes: POST /v1/chat/completions, /v1/completions (stream or not), /v1/embeddings (prefill-only
requests through the scheduler; vectors below), GET /health, /ping, /version,
/v1/models, /metrics, /load, POST /tokenize, /detokenize, and two internal ones: POST
/internal/kv_pull (the PD side channel a decode instance calls) and POST /reset_prefix_cache
(vLLM's dev-mode route; emits AllBlocksCleared). `--api-key` guards /v1/* only, with vLLM's bare
401 body. Every response carries ``x-tokenway-sim: 1``.

A client that disconnects cancels its handler (aiohttp ``handler_cancellation``); the handler then
aborts the request in the engine, which frees its blocks at once and counts it as ``abort``.

Prompts in bodies over ``OFFLOAD_BODY_BYTES`` are tokenized in a worker thread (tiktoken releases the
GIL), as vLLM's API server tokenizes off its engine loop: a burst of long prompts must not stop
/health and /metrics from answering, or a gateway would take a busy engine for a dead one.

Responses and Messages
----------------------
The simulated engine's Responses and Anthropic Messages routes (`add_routes`), as `vllm serve` has them:
POST /v1/responses, GET /v1/responses/{id}, POST /v1/messages, POST /v1/messages/count_tokens.

Both run as chat requests (`backends.protocols` translates the body; `generation.py` runs it and
re-encodes the answer or the stream), so a prompt costs the same ids, and hits the same prefix
cache, through any of the three APIs. Stored responses (`store`, default true; vLLM keeps them
when its responses store is enabled) live in a small bounded map per engine, enough for
`previous_response_id` against the engine alone; the gateway keeps its own store and sends the
whole conversation instead.

Embedding vectors
-----------------
`embed`, what the simulated model "embeds": deterministic unit vectors hashed from the token ids.

Feature hashing over the bag of tokens: every token adds +1 or -1 to `HASHES_PER_TOKEN` coordinates
picked by a 64-bit mix (splitmix64) of its id and the engine seed; the sum is scaled to unit length.
The same ids give the same vector (any dimension), texts that share tokens point in similar
directions (cosine ~ overlap), unrelated texts are near orthogonal. float32, as vLLM returns them.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware

from backends import tokenization
from backends.protocols import ProtocolError, anthropic, responses
from sim import generation, text_gen
from sim.config import VLLM_VERSION
from sim.engine import SimEngine
from sim.engine import install as install_sleep_routes
from sim.generation import BadRequest, ChunkTemplate, FinishWaiter, TokenWriter
from sim.lora import LoraError, adapter_names, adapter_of
from sim.scheduler import Request, new_id

ENGINE_KEY = web.AppKey("engine", SimEngine)
CREATED_KEY = web.AppKey("created", int)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OFFLOAD_BODY_BYTES = 32 * 1024


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
        if request.path.startswith("/v1/messages"):
            return _json(anthropic.error_body(exc.status, exc.message), status=exc.status)
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


FAULTS_KEY = web.AppKey("faults", list)


def _fail_on(marker: str) -> Middleware:
    """`--fail-on-marker` (tests only): a generation request whose body holds `marker` answers 500
    with vLLM's error body, as an engine that fails on one request's content does; counted."""
    needle = marker.encode()

    @web.middleware
    async def fail(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and request.path.startswith("/v1/") and needle in await request.read():
            request.app[FAULTS_KEY].append(request.path)
            return error_response(500, f"EngineCore failed on this request (injected on {marker!r})")
        return await handler(request)

    return fail


async def _faults(request: web.Request) -> web.Response:
    return _json({"injected_failures": len(request.app[FAULTS_KEY])})


async def _mark_sim(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-tokenway-sim"] = "1"


def build_app(engine: SimEngine) -> web.Application:
    config = engine.config
    middlewares: list[Middleware] = [_errors]
    if config.api_key:
        middlewares.insert(0, _auth_middleware(config.api_key))
    if config.fail_on_marker:
        middlewares.append(_fail_on(config.fail_on_marker))
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app[CREATED_KEY] = int(time.time())
    app[FAULTS_KEY] = []
    app.on_response_prepare.append(_mark_sim)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/embeddings", _embeddings)
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
    if engine.lora is not None:  # vLLM's runtime adapter routes (sim/lora.py)
        app.router.add_post("/v1/load_lora_adapter", _load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", _unload_lora_adapter)
    if config.fail_on_marker:
        app.router.add_get("/internal/faults", _faults)
    add_routes(app, engine)  # /v1/responses and /v1/messages (below)
    install_sleep_routes(app, engine)  # vLLM's sleep routes, with VLLM_SERVER_DEV_MODE and --enable-sleep-mode
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
    lora = request.app[ENGINE_KEY].lora
    if lora is not None:
        data += lora.models(created)
    return _json({"object": "list", "data": data})


async def _load_lora_adapter(request: web.Request) -> web.Response:
    body = await _read_json(request)
    lora = request.app[ENGINE_KEY].lora
    assert lora is not None
    name, path = body.get("lora_name"), body.get("lora_path")
    try:
        lora.register(name if isinstance(name, str) else "", path if isinstance(path, str) else "")
    except LoraError as exc:
        raise BadRequest(exc.message, "lora_name", status=exc.status) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def _unload_lora_adapter(request: web.Request) -> web.Response:
    body = await _read_json(request)
    lora = request.app[ENGINE_KEY].lora
    assert lora is not None
    name = body.get("lora_name")
    try:
        lora.unregister(name if isinstance(name, str) else "")
    except LoraError as exc:
        raise BadRequest(exc.message, "lora_name", status=exc.status) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = engine.metrics.render()
    if engine.lora is not None:
        s = engine.scheduler
        running = [r.lora_name for r in s.running if r.lora_name]
        waiting = [r.lora_name for r in s.waiting if r.lora_name]
        body += engine.lora.prometheus(running, waiting)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _load(request: web.Request) -> web.Response:
    s = request.app[ENGINE_KEY].scheduler
    return _json({"server_load": len(s.running) + s.num_waiting})


_read_json = generation.read_json


def _long(request: web.Request) -> bool:
    return (request.content_length or 0) > OFFLOAD_BODY_BYTES


async def _chat_ids(request: web.Request, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    """Chat prompt ids: through the message cache on the loop, or (long bodies) uncached in a thread
    (the cache is the loop's; both give the same ids)."""
    if _long(request):
        return await asyncio.to_thread(tokenization.chat_prompt_ids, messages, tools)
    return generation.chat_prompt_ids(messages, tools)


async def _chat_prompt(request: web.Request, body: dict[str, Any]) -> list[int]:
    """A chat request's prompt ids. With vLLM's `continue_final_message` (and `add_generation_prompt:
    false`) the last message, an assistant's, is continued: its text follows the assistant header
    without the end-of-message footer, so generation picks up where it stops."""
    messages = generation.messages(body)
    if not body.get("continue_final_message"):
        return await _chat_ids(request, messages, body.get("tools"))
    if body.get("add_generation_prompt", True):
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if not messages or messages[-1].get("role") != "assistant":
        raise BadRequest("`continue_final_message` needs the last message to be the assistant's", "messages")
    head = await _chat_ids(request, messages[:-1], body.get("tools"))  # ends with the assistant header
    return [*head, *tokenization.encode(tokenization.message_text(messages[-1]))]


async def _completion_ids(request: web.Request, prompt: str | list[int]) -> list[int]:
    if _long(request) and isinstance(prompt, str):
        return await asyncio.to_thread(tokenization.completion_prompt_ids, prompt)
    return tokenization.completion_prompt_ids(prompt)


async def _tokenize(request: web.Request) -> web.Response:
    body = await _read_json(request)
    config = request.app[ENGINE_KEY].config
    if "messages" in body:
        ids = await _chat_ids(request, generation.messages(body), body.get("tools"))
    elif "prompt" in body:
        ids = await _completion_ids(request, _single_prompt(body["prompt"]))
    else:
        raise BadRequest("Either 'prompt' or 'messages' is required", "prompt")
    return _json({"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids, "token_strs": None})


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
    topology = engine.config.topology
    return _json(
        {
            "num_tokens": req.num_prompt,
            "block_size": engine.config.block_size,
            "engine_id": engine.config.engine_id,
            "topology": {"node": topology.node, "rack": topology.rack, "zone": topology.zone},
        }
    )


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    ok = request.app[ENGINE_KEY].reset_prefix_cache()
    return web.Response(status=200 if ok else 409)


# --- generation ----------------------------------------------------------------------------------


def _single_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return _single_prompt(prompt[0])
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)", "prompt")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request)
    engine = request.app[ENGINE_KEY]
    generation.check_common(body, engine.config, adapter_names(engine.lora))
    prompt_ids = await _chat_prompt(request, body)
    if not generation.read_spec(body, chat=True).plain:
        return await generation.generate(
            request,
            engine,
            body,
            prompt_ids,
            api="chat",
            response_id=_response_id(request, "chatcmpl"),
            model_name=str(body.get("model") or engine.config.served_model_name),
        )
    return await _generate(request, engine, body, prompt_ids, chat=True)


def _response_id(request: web.Request, prefix: str) -> str:
    return f"{prefix}-{request.headers.get('X-Request-Id') or new_id()}"


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request)
    engine = request.app[ENGINE_KEY]
    generation.check_common(body, engine.config, adapter_names(engine.lora))
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", "prompt")
    prompt_ids = await _completion_ids(request, _single_prompt(body["prompt"]))
    if not generation.read_spec(body, chat=False).plain:
        return await generation.generate(
            request,
            engine,
            body,
            prompt_ids,
            api="completions",
            response_id=_response_id(request, "cmpl"),
            model_name=str(body.get("model") or engine.config.served_model_name),
        )
    return await _generate(request, engine, body, prompt_ids, chat=False)


async def _generate(
    request: web.Request, engine: SimEngine, body: dict[str, Any], prompt_ids: list[int], chat: bool
) -> web.StreamResponse:
    config = engine.config
    max_tokens = (
        generation.int_field(body, "max_completion_tokens", "max_tokens")
        if chat
        else generation.int_field(body, "max_tokens")
    )
    min_tokens = generation.int_field(body, "min_tokens") or 0
    generation.check_length(len(prompt_ids), max_tokens, config)
    generation.check_blocks(len(prompt_ids), config, "messages" if chat else "prompt")
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
        lora_name=adapter_of(engine.lora, body),
    )
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    base_id = request.headers.get("X-Request-Id") or new_id()
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
    model_name = str(body.get("model") or config.served_model_name)
    created = int(time.time())
    engine.submit(req)
    try:
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return await _stream(
                request, engine, req, done, response_id, model_name, created, chat, bool(options.get("include_usage"))
            )
        req.notify = FinishWaiter(req, done).step
        if not req.finished:
            await done
        text = text_gen.render(req.output_ids[: req.num_output])
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": req.finish_reason, "stop_reason": None}
        if chat:
            choice["message"] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "tool_calls": [],
                "reasoning_content": None,
            }
        else:
            choice["text"] = text
        result: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": [choice],
            "usage": generation.usage(req),
            "prompt_logprobs": None,
            "kv_transfer_params": engine.kv_transfer_params(req) if req.remote_decode else None,
            "metrics": req.timings(),
        }
        return _json(result)
    finally:
        req.notify = None
        if not req.finished:
            engine.abort(req)


# --- embeddings ----------------------------------------------------------------------------------

MAX_EMBEDDING_DIMENSIONS = 65536


def _embedding_inputs(body: dict[str, Any], cached: bool = True) -> list[list[int]]:
    """Token ids of each input: a string, a list of strings, a list of ids, a list of id lists, or
    vLLM's chat-style `messages` (one input). `cached` False: off the loop, without the cache."""
    if "input" not in body and "messages" in body:
        chat_ids = generation.chat_prompt_ids if cached else tokenization.chat_prompt_ids
        return [chat_ids(generation.messages(body))]
    value = body.get("input")
    if isinstance(value, str):
        inputs = [tokenization.completion_prompt_ids(value)]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        inputs = [tokenization.completion_prompt_ids(v) for v in value]
    elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        inputs = [[int(v) for v in value]]
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v) for v in value)
    ):
        inputs = [[int(t) for t in v] for v in value]
    else:
        raise BadRequest(
            "'input' must be a string, a list of strings, a list of token ids or a list of token id lists", "input"
        )
    if any(not ids for ids in inputs):
        raise BadRequest("'input' cannot contain an empty input", "input")
    vocab = tokenization.encoding().n_vocab
    for ids in inputs:  # as vLLM: an id outside the vocabulary is the client's error, not the engine's
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"Token id {bad} is out of vocabulary", "input")
    return inputs


async def _embeddings(request: web.Request) -> web.Response:
    body = await _read_json(request)
    engine = request.app[ENGINE_KEY]
    config = engine.config
    generation.check_common(body, config, adapter_names(engine.lora))
    inputs = await asyncio.to_thread(_embedding_inputs, body, False) if _long(request) else _embedding_inputs(body)
    dimensions = body.get("dimensions")
    if dimensions is None:
        dimensions = config.embedding_dim
    elif (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or not (1 <= dimensions <= MAX_EMBEDDING_DIMENSIONS)
    ):
        raise BadRequest(f"'dimensions' must be an integer from 1 to {MAX_EMBEDDING_DIMENSIONS}", "dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    for ids in inputs:
        if len(ids) > config.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {config.max_model_len} tokens. However, you "
                f"requested {len(ids)} tokens in the input for embedding generation. Please reduce the "
                "length of the input.",
                "input",
            )
        generation.check_blocks(len(ids), config, "input")
    loop = asyncio.get_running_loop()
    requests: list[tuple[Request, asyncio.Future[None]]] = []
    for ids in inputs:
        req = engine.create_request(ids, max_tokens=None, pooling=True, lora_name=adapter_of(engine.lora, body))
        done: asyncio.Future[None] = loop.create_future()
        req.notify = FinishWaiter(req, done).step
        requests.append((req, done))
        engine.submit(req)
    try:
        for req, done in requests:
            if not req.finished:
                await done
    finally:
        for req, _done in requests:
            req.notify = None
            if not req.finished:
                engine.abort(req)
    data: list[dict[str, Any]] = []
    for index, (req, _done) in enumerate(requests):
        vector = embed(req.prompt_ids, dimensions, config.seed)
        data.append(
            {
                "index": index,
                "object": "embedding",
                "embedding": encode_base64(vector) if encoding == "base64" else vector,
            }
        )
    prompt_tokens = sum(req.num_prompt for req, _ in requests)
    result = {
        "id": f"embd-{new_id()}",
        "object": "list",
        "created": int(time.time()),
        "model": str(body.get("model") or config.served_model_name),
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
    return web.Response(body=orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY), content_type="application/json")


async def _stream(
    request: web.Request,
    engine: SimEngine,
    req: Request,
    done: asyncio.Future[None],
    response_id: str,
    model_name: str,
    created: int,
    chat: bool,
    include_usage: bool,
) -> web.StreamResponse:
    """Role chunk here; token chunks from the engine loop (generation.TokenWriter); the rest here once the
    request has finished."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    base = {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model_name,
    }

    def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None and not role:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        return {**base, "choices": [choice]}

    def event(data: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(data) + b"\n\n"

    # The role chunk (chat) or nothing (completions) also sends the headers, before any direct write.
    await response.write(event(chunk(None, None, role=True)) if chat else b"")
    transport = request.transport
    if transport is None:  # the client is already gone
        return response
    chunked = response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"
    writer = TokenWriter(req, transport, ChunkTemplate(base, chat), chunked, done)
    req.notify = writer.step
    writer.step()  # tokens of steps that ended while the headers went out, if any
    if not req.finished:
        await done
    text = text_gen.render(req.output_ids[writer.sent : req.num_output])
    data = chunk(text, req.finish_reason)
    data["metrics"] = timings = req.timings()
    if req.remote_decode:
        data["kv_transfer_params"] = engine.kv_transfer_params(req)
    tail = event(data)
    if include_usage:
        tail += event({**base, "choices": [], "usage": generation.usage(req), "metrics": timings})
    await response.write_eof(tail + b"data: [DONE]\n\n")
    return response


# --- Responses and Messages -----------------------------------------------------------------------

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
    generation.check_common({"model": body.get("model")}, engine.config, adapter_names(engine.lora))
    return str(body.get("model") or engine.config.served_model_name)


async def _create_response(request: web.Request) -> web.StreamResponse:
    body = await generation.read_json(request)
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
    prompt_ids = generation.chat_prompt_ids(chat["messages"], chat.get("tools"))
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
    body = await generation.read_json(request)
    engine = request.app[_ENGINE]
    model = _model_name(body, engine)
    chat = _salted(_translate(anthropic.to_chat, body), body)
    prompt_ids = generation.chat_prompt_ids(chat["messages"], chat.get("tools"))
    message_id = f"msg_{request.headers.get('X-Request-Id') or new_id()}"
    return await generation.generate(
        request, engine, chat, prompt_ids, api="messages", response_id=message_id, model_name=model, original=body
    )


async def _count_tokens(request: web.Request) -> web.Response:
    body = await generation.read_json(request)
    engine = request.app[_ENGINE]
    _model_name(body, engine)
    chat = _translate(anthropic.to_chat, body, count_only=True)
    prompt_ids = generation.chat_prompt_ids(chat["messages"], chat.get("tools"))
    return web.json_response(anthropic.count_tokens_body(len(prompt_ids)))


# --- embedding vectors ----------------------------------------------------------------------------

HASHES_PER_TOKEN = 4
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def embed(token_ids: Sequence[int], dimensions: int, seed: int = 0) -> npt.NDArray[np.float32]:
    """The unit vector (float32, `dimensions` long) of one input's token ids."""
    if dimensions < 1:
        raise ValueError("dimensions must be >= 1")
    ids = np.asarray(token_ids, dtype=np.uint64).reshape(-1, 1)
    salts = (
        np.arange(1, HASHES_PER_TOKEN + 1, dtype=np.uint64)
        + np.uint64(seed & (2**32 - 1)) * np.uint64(HASHES_PER_TOKEN + 1)
    ) * _GOLDEN
    hashed = _splitmix64(ids * _MIX2 + salts).ravel()  # wraps mod 2**64, as intended
    index = (hashed >> np.uint64(1)) % np.uint64(dimensions)
    sign = 1.0 - 2.0 * (hashed & np.uint64(1)).astype(np.float64)
    vector = np.bincount(index.astype(np.intp), weights=sign, minlength=dimensions)
    norm = float(np.linalg.norm(vector))
    if norm == 0.0:  # no tokens, or every contribution cancelled: a fixed axis of the seed
        vector[int(seed) % dimensions] = 1.0
        norm = 1.0
    result: npt.NDArray[np.float32] = (vector / norm).astype(np.float32)
    return result


def encode_base64(vector: npt.NDArray[np.float32]) -> str:
    """OpenAI's `encoding_format: "base64"`: the float32 little-endian bytes, base64."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")

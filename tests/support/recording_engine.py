"""An OpenAI-compatible engine that records every request body it receives (tests only).

    python -m tests.support.recording_engine --port P [--bad-sse] [--fail-on FIELD] [--slow-tokenize S]

Serves /health, /metrics (vLLM's load metrics, all zero), /v1/models and /v1/chat/completions
(a fixed two-token answer, streamed or not, with usage). `GET /_bodies` returns the bodies received.
`--bad-sse` sends one malformed event in every stream; `--fail-on FIELD` answers 500 to any request
whose body has FIELD (a request that crashes the engine whatever endpoint it reaches);
`--slow-tokenize S` makes `POST /tokenize` (vLLM's, for precise prefix routing) take S seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

BODIES = web.AppKey("bodies", list)
OPTIONS = web.AppKey("options", argparse.Namespace)
METRICS = (
    "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
    "vllm:prefix_cache_queries_total 0\nvllm:prefix_cache_hits_total 0\n"
)


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-rec",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    request.app[BODIES].append(body)
    options = request.app[OPTIONS]
    if options.fail_on and options.fail_on in body:
        return web.Response(status=500, text="engine crashed on this input")
    model = str(body.get("model", "m"))
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    if not body.get("stream"):
        answer = {
            "id": "chatcmpl-rec",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok ok"}, "finish_reason": "stop"}],
            "usage": usage,
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_chunk(model, {"role": "assistant", "content": ""}))
    await response.write(_chunk(model, {"content": "ok"}))
    if options.bad_sse:
        await response.write(b'data: {"choices": [{"delta": {"content": \x00broken\n\n')
    await response.write(_chunk(model, {"content": " ok"}, "stop"))
    final = {"id": "chatcmpl-rec", "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [],
             "usage": usage}  # fmt: skip
    await response.write(b"data: " + orjson.dumps(final) + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    return response


async def tokenize(request: web.Request) -> web.Response:
    await asyncio.sleep(request.app[OPTIONS].slow_tokenize)
    return web.Response(
        body=orjson.dumps({"count": 3, "max_model_len": 8192, "tokens": [1, 2, 3]}), content_type="application/json"
    )


async def bodies(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(request.app[BODIES]), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=METRICS, content_type="text/plain")


async def models(request: web.Request) -> web.Response:
    return web.Response(
        body=orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}), content_type="application/json"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bad-sse", action="store_true")
    parser.add_argument("--fail-on", default="")
    parser.add_argument("--slow-tokenize", type=float, default=0.0)
    options = parser.parse_args()
    app = web.Application()
    app[BODIES] = []
    app[OPTIONS] = options
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/_bodies", bodies)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=options.port, print=None, access_log=None)


if __name__ == "__main__":
    main()

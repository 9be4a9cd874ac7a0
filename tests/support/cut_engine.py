"""An OpenAI-compatible engine whose streams can fail mid-answer, on purpose (tests only).

    python -m tests.support.cut_engine --port P [--cut-after N] [--cut reset|truncate|error]
                                        [--tool-call] [--chunks M] [--word W]

Serves /health, /metrics (vLLM's load metrics, all zero), /v1/models, /tokenize and
/v1/chat/completions, streamed or not. A stream sends a role chunk, then `--chunks` content chunks
(`" W1"`, `" W2"`, ...), `finish_reason: stop` and a usage chunk (prompt 11, completion the chunks
sent). With `--cut-after N` it fails after N content chunks instead: `reset` drops the connection,
`truncate` ends the body cleanly without a finish, `error` sends an error event then `[DONE]`;
`--tool-call` sends the first chunk of a tool call before the cut. `GET /_bodies` returns the bodies
received (a continuation's `messages` and `continue_final_message` are read from there).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from tests.support.recording_engine import BODIES, bodies, health, metrics, models  # the same engine routes

OPTIONS = web.AppKey("options", argparse.Namespace)
PROMPT_TOKENS = 11


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return _event({"id": "chatcmpl-cut", "object": "chat.completion.chunk", "created": int(time.time()),
                   "model": model, "choices": [choice]})  # fmt: skip


async def chat(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    request.app[BODIES].append(body)
    options = request.app[OPTIONS]
    model = str(body.get("model", "m"))
    words = [f" {options.word}{i + 1}" for i in range(options.chunks)]
    if not body.get("stream"):
        answer = {"id": "chatcmpl-cut", "object": "chat.completion", "created": int(time.time()), "model": model,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                               "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(words),
                            "total_tokens": PROMPT_TOKENS + len(words)}}  # fmt: skip
        return web.Response(body=orjson.dumps(answer), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_chunk(model, {"role": "assistant", "content": ""}))
    cut = options.cut_after
    for position, word in enumerate(words):
        if cut is not None and position == cut:
            break
        await response.write(_chunk(model, {"content": word}))
        await asyncio.sleep(0.01)
    else:
        cut = None
    if cut is not None:
        if options.tool_call:
            call = {
                "index": 0,
                "id": "call_cut",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"q'},
            }
            await response.write(_chunk(model, {"tool_calls": [call]}))
        if options.cut == "reset":
            assert request.transport is not None
            request.transport.abort()  # the connection drops mid-stream, as a killed engine's does
            return response
        if options.cut == "error":
            await response.write(_event({"error": {"message": "engine failure", "type": "InternalServerError",
                                                   "code": 500}}))  # fmt: skip
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()  # truncate (and error): the body ends without a finish
        return response
    await response.write(_chunk(model, {}, "stop"))
    usage = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": len(words),
        "total_tokens": PROMPT_TOKENS + len(words),
    }
    await response.write(_event({"id": "chatcmpl-cut", "object": "chat.completion.chunk", "created": 0, "model": model,
                                 "choices": [], "usage": usage}))  # fmt: skip
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def tokenize(request: web.Request) -> web.Response:
    payload = {"count": PROMPT_TOKENS, "max_model_len": 8192, "tokens": list(range(PROMPT_TOKENS))}
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cut-after", type=int, default=None)
    parser.add_argument("--cut", choices=("reset", "truncate", "error"), default="reset")
    parser.add_argument("--tool-call", action="store_true")
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--word", default="w")
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

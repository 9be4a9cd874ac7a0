"""Request checks shared by every generating route of the simulated engine, with vLLM's wording.

`BadRequest` carries the status and `param`; the app's error middleware renders it in the shape of
the route's API (OpenAI's for /v1/*, Anthropic's under /v1/messages).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import orjson
from aiohttp import web

from sim.config import EngineConfig
from sim.outputs import MAX_CHOICES
from sim.request import Request


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    return body


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if not all(isinstance(m, dict) for m in value):
        raise BadRequest("each message must be an object", "messages")
    return value


def int_field(body: dict[str, Any], *names: str) -> int | None:
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


def check_common(body: dict[str, Any], config: EngineConfig, adapters: Collection[str] = ()) -> None:
    """`adapters`: the LoRA adapters the engine serves besides its model (sim/lora.py)."""
    model = body.get("model")
    if model is not None and model not in config.served_model_names and model != config.model and model not in adapters:
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES):
        raise BadRequest(f"'n' must be an integer from 1 to {MAX_CHOICES}", "n")


def check_length(prompt_len: int, max_tokens: int | None, config: EngineConfig, param: str = "messages") -> None:
    limit = config.max_model_len
    if prompt_len >= limit:
        raise BadRequest(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            param,
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise BadRequest(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {limit} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {limit} - {prompt_len}).",
            "max_tokens",
        )


def check_blocks(prompt_len: int, config: EngineConfig, param: str) -> None:
    needed_blocks = -(-(prompt_len + 1) // config.block_size)
    if needed_blocks > config.num_gpu_blocks:
        raise BadRequest(f"the prompt needs {needed_blocks} KV blocks; the engine has {config.num_gpu_blocks}", param)


def usage(req: Request, completion_tokens: int | None = None) -> dict[str, Any]:
    completion = req.num_output if completion_tokens is None else completion_tokens
    return {
        "prompt_tokens": req.num_prompt,
        "completion_tokens": completion,
        "total_tokens": req.num_prompt + completion,
        "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens or 0},
    }

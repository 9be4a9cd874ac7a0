"""Generation for everything but the plain one-choice text stream: `n` choices, tool calls, JSON,
`stop`, logprobs and `seed` (`outputs.py` plans them), and the Responses and Messages APIs, which
run as chat requests whose chunks are re-encoded (`backends.protocols`), as vLLM serves them.

Streams are still written from the engine loop (`ChoiceStream.step` is each choice's `notify`): a
step's new tokens become one chat chunk dict per choice, which the API's encoder turns into bytes
(a chat `data:` line, or Responses / Anthropic events). The plain chat and completions stream keeps
the pre-encoded template path of `sse.py`, the one the benchmarks load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import orjson
from aiohttp import hdrs, web

from backends.protocols import anthropic, responses
from backends.protocols.responses_stream import ResponsesStream
from sim import outputs, validation
from sim.engine import SimEngine
from sim.lora import adapter_of
from sim.outputs import Choice, OutputSpec, SpecError
from sim.request import Status
from sim.sse import WRITE_BUFFER_LIMIT
from sim.validation import BadRequest

Api = Literal["chat", "completions", "responses", "messages"]
_FINISHED = Status.FINISHED


class Encoder(Protocol):
    def start(self) -> bytes: ...
    def feed(self, chunk: dict[str, Any]) -> bytes: ...
    def finish(self) -> bytes: ...


class ChatEncoder:
    def start(self) -> bytes:
        return b""

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def finish(self) -> bytes:
        return b"data: [DONE]\n\n"


class ResponsesEncoder:
    def __init__(self, original: Mapping[str, Any], model: str, response_id: str) -> None:
        self.stream = ResponsesStream(original, model, response_id)

    def start(self) -> bytes:
        return self.stream.start()

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return self.stream.feed(chunk)

    def finish(self) -> bytes:
        return self.stream.finish()


class MessagesEncoder:
    def __init__(self, original: Mapping[str, Any], model: str, message_id: str, prompt_tokens: int) -> None:
        self.stream = anthropic.MessagesStream(original, model, message_id)
        self.prompt_tokens = prompt_tokens

    def start(self) -> bytes:
        return self.stream.start(self.prompt_tokens)

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return self.stream.feed(chunk)

    def finish(self) -> bytes:
        return self.stream.finish()


def _delta(choice: Choice, text: str, first: bool) -> dict[str, Any]:
    if choice.tool_name is None:
        return {"content": text}
    call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
    if first:
        call["id"], call["type"] = choice.tool_call_id, "function"
        call["function"] = {"name": choice.tool_name, "arguments": text}
    return {"tool_calls": [call]}


class ChunkBuilder:
    """Chat (or completions) chunk dicts of a request's choices."""

    def __init__(self, base: dict[str, Any], chat: bool, spec: OutputSpec) -> None:
        self.base, self.chat, self.spec = base, chat, spec
        self.offsets: dict[int, int] = {}

    def tokens(self, choice: Choice, start: int, end: int, first: bool, finish: str | None = None) -> dict[str, Any]:
        text = choice.text(start, end)
        spec = self.spec
        entry: dict[str, Any] = {"index": choice.index}
        if self.chat:
            entry["delta"] = _delta(choice, text, first) if (text or first) else {}
            lps = (
                outputs.chat_logprobs(choice, start, end, spec.top_logprobs) if spec.logprobs and end > start else None
            )
            entry["logprobs"] = {"content": lps} if lps is not None else None
        else:
            entry["text"] = text
            offset = self.offsets.get(choice.index, 0)
            self.offsets[choice.index] = offset + len(text)
            lp = spec.logprobs and end > start
            entry["logprobs"] = (
                outputs.completion_logprobs(choice, start, end, spec.top_logprobs, offset) if lp else None
            )
        entry["finish_reason"] = finish
        if finish is not None:
            entry["stop_reason"] = choice.stop_string
        return {**self.base, "choices": [entry]}

    def role(self, choice: Choice) -> dict[str, Any]:
        entry = {
            "index": choice.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**self.base, "choices": [entry]}


class ChoiceStream:
    """Each choice's `notify`: its new tokens as one chunk through the encoder, onto the socket."""

    def __init__(
        self,
        choices: list[Choice],
        transport: asyncio.WriteTransport,
        chunked: bool,
        done: asyncio.Future[None],
        encoder: Encoder,
        builder: ChunkBuilder,
    ) -> None:
        self.choices, self.transport, self.chunked, self.done = choices, transport, chunked, done
        self.encoder, self.builder = encoder, builder
        self.sent = [0] * len(choices)
        self.started = [False] * len(choices)

    def notifier(self, index: int) -> Any:
        return lambda: self.step(index)

    def step(self, index: int) -> None:
        choice = self.choices[index]
        req = choice.req
        if req.status is _FINISHED:
            if all(c.req.status is _FINISHED for c in self.choices) and not self.done.done():
                self.done.set_result(None)
            return
        produced, sent = req.num_output, self.sent[index]
        transport = self.transport
        if produced <= sent or transport.is_closing() or transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
            return
        if not choice.text(sent, produced) and self.started[index]:
            return  # tokens that end inside a character: their text comes with the next one
        chunk = self.builder.tokens(choice, sent, produced, not self.started[index])
        self.sent[index], self.started[index] = produced, True
        self.write(self.encoder.feed(chunk))

    def write(self, data: bytes) -> None:
        if data:
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    def tail(self, usage: dict[str, Any] | None, metrics: dict[str, Any] | None) -> bytes:
        """Each choice's unsent tokens and finish reason, the usage chunk, the encoder's end."""
        out = b""
        builder = self.builder
        for choice in self.choices:
            i = choice.index
            chunk = builder.tokens(
                choice, self.sent[i], choice.req.num_output, not self.started[i], choice.finish_reason
            )
            if metrics is not None and i == len(self.choices) - 1:
                chunk["metrics"] = metrics
            out += self.encoder.feed(chunk)
        if usage is not None:
            out += self.encoder.feed({**builder.base, "choices": [], "usage": usage, "metrics": metrics})
        return out + self.encoder.finish()


def read_spec(body: dict[str, Any], chat: bool) -> OutputSpec:
    try:
        return outputs.read_spec(body, chat)
    except SpecError as exc:
        raise BadRequest(exc.message, exc.param) from None


def _usage(choices: list[Choice]) -> dict[str, Any]:
    """One prompt, every choice's completion tokens (OpenAI's and vLLM's `n` accounting)."""
    return validation.usage(choices[0].req, sum(c.req.num_output for c in choices))


def _chat_choice(choice: Choice, spec: OutputSpec, chat: bool) -> dict[str, Any]:
    req = choice.req
    text = choice.text(0, req.num_output)
    entry: dict[str, Any] = {"index": choice.index}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "tool_calls": []}
        if choice.tool_name is not None:
            function = {"name": choice.tool_name, "arguments": text}
            message["content"] = None
            message["tool_calls"] = [{"id": choice.tool_call_id, "type": "function", "function": function}]
        message["reasoning_content"] = None
        entry["message"] = message
        lps = outputs.chat_logprobs(choice, 0, req.num_output, spec.top_logprobs) if spec.logprobs else None
        entry["logprobs"] = {"content": lps} if lps is not None else None
    else:
        entry["text"] = text
        lp = spec.logprobs
        entry["logprobs"] = outputs.completion_logprobs(choice, 0, req.num_output, spec.top_logprobs, 0) if lp else None
    entry["finish_reason"] = choice.finish_reason
    entry["stop_reason"] = choice.stop_string
    return entry


async def generate(
    request: web.Request,
    engine: SimEngine,
    body: dict[str, Any],
    prompt_ids: list[int],
    *,
    api: Api,
    response_id: str,
    model_name: str,
    original: Mapping[str, Any] | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> web.StreamResponse:
    """Run one request (its `n` choices) through the engine; answer in `api`'s shape.

    `body` is the chat (or completions) body; `original` the client's Responses / Messages body;
    `on_result` hears the final object in the API's shape (a stored response).
    """
    config = engine.config
    chat = api != "completions"
    spec = read_spec(body, chat)
    max_tokens = validation.int_field(body, "max_completion_tokens", "max_tokens")
    min_tokens = validation.int_field(body, "min_tokens") or 0
    param = "prompt" if api == "completions" else ("input" if api == "responses" else "messages")
    validation.check_length(len(prompt_ids), max_tokens, config, param)
    validation.check_blocks(len(prompt_ids), config, param)
    salt = body.get("cache_salt")
    ignore_eos = bool(body.get("ignore_eos", False))
    choices: list[Choice] = []
    for index in range(spec.n):
        req = engine.create_request(
            prompt_ids,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            cache_salt=str(salt) if salt else None,
            lora_name=adapter_of(engine.lora, body),
        )
        choices.append(
            outputs.plan_choice(
                req, spec, config.seed, index, output_len_mean=config.output_len_mean, ignore_eos=ignore_eos
            )
        )
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    created = int(time.time())
    base = {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model_name,
    }
    builder = ChunkBuilder(base, chat, spec)
    for choice in choices:
        engine.submit(choice.req)
    try:
        if body.get("stream"):
            return await _stream(
                request, engine, choices, done, builder, api, original, model_name, response_id, body, on_result
            )
        waiter = _AllFinished(choices, done)
        for choice in choices:
            choice.req.notify = waiter.step
        waiter.step()
        if not done.done():
            await done
        result: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": [_chat_choice(c, spec, chat) for c in choices],
            "usage": _usage(choices),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "metrics": choices[0].req.timings(),
        }
        if api == "responses":
            assert original is not None
            result = responses.from_chat(result, original, response_id, model_name)
        elif api == "messages":
            assert original is not None
            result = anthropic.from_chat(result, original, response_id, model_name)
        if on_result is not None:
            on_result(result)
        return web.Response(body=orjson.dumps(result), content_type="application/json")
    finally:
        for choice in choices:
            choice.req.notify = None
            if not choice.req.finished:
                engine.abort(choice.req)


class _AllFinished:
    def __init__(self, choices: list[Choice], done: asyncio.Future[None]) -> None:
        self.choices, self.done = choices, done

    def step(self) -> None:
        if all(c.req.status is _FINISHED for c in self.choices) and not self.done.done():
            self.done.set_result(None)


async def _stream(
    request: web.Request,
    engine: SimEngine,
    choices: list[Choice],
    done: asyncio.Future[None],
    builder: ChunkBuilder,
    api: Api,
    original: Mapping[str, Any] | None,
    model_name: str,
    response_id: str,
    body: dict[str, Any],
    on_result: Callable[[dict[str, Any]], None] | None,
) -> web.StreamResponse:
    encoder: Encoder
    if api == "responses":
        assert original is not None
        encoder = ResponsesEncoder(original, model_name, response_id)
    elif api == "messages":
        assert original is not None
        encoder = MessagesEncoder(original, model_name, response_id, choices[0].req.num_prompt)
    else:
        encoder = ChatEncoder()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = encoder.start()
    if builder.chat:
        for choice in choices:
            head += encoder.feed(builder.role(choice))
    await response.write(head)
    transport = request.transport
    if transport is None:
        return response
    chunked = response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"
    stream = ChoiceStream(choices, transport, chunked, done, encoder, builder)
    for index, choice in enumerate(choices):
        choice.req.notify = stream.notifier(index)
    for index in range(len(choices)):
        stream.step(index)
    if not done.done():
        await done
    options = body.get("stream_options") or {}
    wants_usage = api in ("responses", "messages") or bool(options.get("include_usage"))
    metrics = choices[0].req.timings() if api in ("chat", "completions") else None
    await response.write_eof(stream.tail(_usage(choices) if wants_usage else None, metrics))
    if on_result is not None and isinstance(encoder, ResponsesEncoder):
        on_result(encoder.stream.response)
    return response

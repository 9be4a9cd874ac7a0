"""Generating requests of the simulated engine, from body to bytes: vLLM's checks and error wording,
the chat prompt's ids, and the two ways a stream is written from the engine loop (the plain
pre-encoded one, and the one for everything else).

Generation for everything but the plain one-choice text stream: `n` choices, tool calls, JSON,
`stop`, logprobs and `seed` (`outputs.py` plans them), and the Responses and Messages APIs, which
run as chat requests whose chunks are re-encoded (`backends.protocols`), as vLLM serves them.

Streams are still written from the engine loop (`ChoiceStream.step` is each choice's `notify`): a
step's new tokens become one chat chunk dict per choice, which the API's encoder turns into bytes
(a chat `data:` line, or Responses / Anthropic events). The plain chat and completions stream keeps
the pre-encoded template path (below), the one the benchmarks load.

The plain stream, pre-encoded
-----------------------------
Streamed completions as pre-encoded bytes, written by the engine loop straight to the socket.

A token chunk is the same JSON every time but for its text, so it is encoded once per request, split
where the text goes (`ChunkTemplate`); the text of each vocabulary id is JSON-escaped once per
process (`text_gen.json_text`). A step's tokens then cost one bytes format and one socket write per
streaming request, called from the engine loop (`TokenWriter.step` is the request's `notify`), without
waking the request's handler: the handler only writes the role chunk before and the final chunk,
usage, ``[DONE]`` and the end of the body after.

The bytes are what ``orjson.dumps`` gives for the chunk dict the handler used to build, framed as an
HTTP/1.1 chunk when the response is chunked. A client that stops reading does not grow the
transport's buffer without bound: past `WRITE_BUFFER_LIMIT` tokens are held back and go out together
in a later step's chunk (or the final one), as they would from a handler blocked on drain.

Checks
------
`BadRequest` and the request checks shared by every generating route of the simulated engine, with
vLLM's wording.

`BadRequest` carries the status and `param`; the app's error middleware renders it in the shape of
the route's API (OpenAI's for /v1/*, Anthropic's under /v1/messages).

Prompt ids
----------
`chat_prompt_ids`: chat prompt ids with each message's ids remembered: multi-turn clients resend
the whole history every turn, and tokenizing it again is the largest per-request cost of a simulated engine.

The last message of a request is looked up but not stored (it is usually new; it is stored when it
comes back as history), so single-message traffic costs nothing extra.

`chat_prompt_ids` returns exactly `backends.tokenization.chat_prompt_ids` (a message's ids depend
only on its role and its text, `tokenization.message_text`). One process-wide LRU, shared by every
engine of a fleet (a conversation's turns may land on different instances), bounded by the number
of tokens it holds; ids are kept as uint32 arrays (4 bytes a token).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Literal, Protocol

import orjson
from aiohttp import hdrs, web

from backends import tokenization
from backends.protocols import anthropic, responses
from backends.protocols.responses import ResponsesStream
from sim import outputs, text_gen
from sim.config import EngineConfig
from sim.engine import SimEngine
from sim.lora import adapter_of
from sim.outputs import MAX_CHOICES, Choice, OutputSpec, SpecError
from sim.scheduler import Request, Status

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
    return usage(choices[0].req, sum(c.req.num_output for c in choices))


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
    max_tokens = int_field(body, "max_completion_tokens", "max_tokens")
    min_tokens = int_field(body, "min_tokens") or 0
    param = "prompt" if api == "completions" else ("input" if api == "responses" else "messages")
    check_length(len(prompt_ids), max_tokens, config, param)
    check_blocks(len(prompt_ids), config, param)
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


# --- the plain stream, pre-encoded ----------------------------------------------------------------

WRITE_BUFFER_LIMIT = 256 * 1024
_SENTINEL = "\x01"
_SENTINEL_JSON = b'"\\u0001"'


class ChunkTemplate:
    """``data: {chunk}\\n\\n`` of a token chunk, as `head + text + tail` (text JSON-escaped)."""

    __slots__ = ("fixed", "head", "tail")

    def __init__(self, base: dict[str, Any], chat: bool) -> None:
        choice: dict[str, Any]
        if chat:
            choice = {"index": 0, "delta": {"content": _SENTINEL}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": _SENTINEL, "logprobs": None, "finish_reason": None}
        encoded = b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"
        head, found, tail = encoded.rpartition(_SENTINEL_JSON)  # the text comes after id and model
        assert found, "chunk template without its text slot"
        self.head = head + b'"'
        self.tail = b'"' + tail
        self.fixed = len(self.head) + len(self.tail)

    def event(self, text: bytes) -> bytes:
        return self.head + text + self.tail


class TokenWriter:
    """`step` is a streaming request's `notify`: after each step, its new tokens as one chunk on the
    socket; once it has finished, resolves `done` for the handler to write the end of the stream.
    (A bound method: called once per token, it is cheaper to call than an instance's __call__.)"""

    __slots__ = ("chunked", "done", "fixed", "head", "req", "sent", "table", "tail", "transport")

    def __init__(
        self,
        req: Request,
        transport: asyncio.WriteTransport,
        template: ChunkTemplate,
        chunked: bool,
        done: asyncio.Future[None],
    ) -> None:
        self.req = req
        self.transport = transport
        self.head, self.tail, self.fixed = template.head, template.tail, template.fixed
        self.chunked = chunked
        self.done = done
        self.sent = 0  # output tokens already on the wire
        self.table = text_gen.json_text()

    def step(self) -> None:
        req = self.req
        if req.status is _FINISHED:
            if not self.done.done():
                self.done.set_result(None)
            return
        produced = req.num_output
        sent = self.sent
        if produced <= sent:
            return
        transport = self.transport
        if transport.is_closing() or transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
            return
        table = self.table
        ids = req.output_ids
        text = table[ids[sent]] if produced == sent + 1 else b"".join([table[i] for i in ids[sent:produced]])
        self.sent = produced
        if self.chunked:
            transport.write(b"%x\r\n%b%b%b\r\n" % (self.fixed + len(text), self.head, text, self.tail))
        else:
            transport.write(self.head + text + self.tail)


class FinishWaiter:
    """`step` is a non-streaming request's `notify`: resolves `done` once the request has finished."""

    __slots__ = ("done", "req")

    def __init__(self, req: Request, done: asyncio.Future[None]) -> None:
        self.req = req
        self.done = done

    def step(self) -> None:
        if self.req.status is _FINISHED and not self.done.done():
            self.done.set_result(None)


# --- checks ---------------------------------------------------------------------------------------


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


# --- prompt ids -----------------------------------------------------------------------------------

MAX_CACHED_TOKENS = 2_000_000


class MessageIdsCache:
    def __init__(self, max_tokens: int = MAX_CACHED_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[str, str], array[int]] = OrderedDict()

    def message_ids(self, message: Mapping[str, Any], store: bool = True) -> list[int]:
        key = (str(message.get("role", "user")), tokenization.message_text(message))
        entries = self._entries
        cached = entries.get(key)
        if cached is not None:
            entries.move_to_end(key)
            self.hits += 1
            return cached.tolist()
        self.misses += 1
        ids = tokenization.message_ids(message)
        if store and len(ids) <= self.max_tokens // 4:
            entries[key] = array("I", ids)
            self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                _key, evicted = entries.popitem(last=False)
                self.tokens -= len(evicted)
        return ids

    def chat_prompt_ids(self, messages: Iterable[Mapping[str, Any]], tools: Any = None) -> list[int]:
        """`tokenization.chat_prompt_ids`, message by message through the cache."""
        ids = tokenization.tools_ids(tools)
        messages = list(messages)
        last = len(messages) - 1
        for index, message in enumerate(messages):
            ids.extend(self.message_ids(message, store=index != last))
        ids.extend(tokenization.generation_prompt_ids())
        return ids


_CACHE = MessageIdsCache()


def chat_prompt_ids(messages: Iterable[Mapping[str, Any]], tools: Any = None) -> list[int]:
    return _CACHE.chat_prompt_ids(messages, tools)

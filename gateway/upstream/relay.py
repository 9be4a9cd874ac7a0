"""Upstream call and relay: the body the engine gets, one POST on the shared upstream client
(`gateway/upstream/client.py`), the answer passed back as received, with what it may carry.

One module for one upstream call because each step shapes the next: the engine-control fields
decide what the engine is asked for (its output limit is the reservation), the relay passes the
answer back, and on the way it takes out the engine's own fields and notes whether the answer ended
in tool calls. The sections below say why each is done as it is.

The relay
---------


Streams are relayed event by event without re-serialising them: the only edits are a byte-level
swap of the `model` value (when the public name differs from the engine's) and dropping the usage
chunk the gateway asked for on the client's behalf. Errors before the first byte reach the caller as
`RetryableUpstream` (connect error, 5xx) so it can try another endpoint; after the first byte they
become one SSE error event and a clean end of stream. A client that goes away closes the upstream
connection at once (the engine aborts the request). A stream with a first-token deadline
(`gateway/upstream/replica_loss.py`) shows its client nothing before its first token, so a replica that stays silent
that long still fails "before the first byte" and the request moves to another.

The engine-control fields
-------------------------

The engine-control fields of an upstream body: the client's dropped (unless its tenant may set
them, `policies/policy.py`), the gateway's own set.

The priority the engine schedules by is the tenant's tier (`tenants.<t>.priority`, a key's override)
on tokenway's scale; each adapter maps it onto its engine's (vLLM: lower runs first) or drops it
where the pool does not schedule by priority. The `normal` tier is every engine's default (vLLM 0,
TensorRT-LLM 0.5), so it is not written. The PD handshake fields are added later by the adapter,
from the prefill engine's answer, never from the client.

Two more fields are always the gateway's, because what is billed and what is shared depend on them:

- **The output limit.** Admission reserved a number of output tokens for the request; an engine
  left to its own default generates until the context is full (vLLM) or until its own default
  limit, however long a `json_schema` with `minItems` or `min_tokens` makes the answer. So the
  engine is told the reservation: the API's limit field is set to the reservation per choice when
  the client gave none, and lowered to it where the client's is larger (a reservation made on a
  fallback model's terms). The engine can then never produce more than was reserved.
- **The prefix-cache salt** (`cache_salt`, vLLM's): each tenant's requests are salted with a value
  derived from its cache group (`tenants.<t>.cache_group`, else the tenant), so a tenant's prompts
  never hit another tenant's cached blocks and `cached_tokens` says nothing about what others sent
  (`policies/policy.py: cache_salt`). The prefix index keys its blocks with the same salt
  (`RequestFacts.cache_salt`), so routing hits stay per tenant too.

The engine's own fields
-----------------------

What an engine's answer may carry to the client: the API's own fields, not vLLM's additions.

vLLM writes fields of its own into its answers; a strict client (one that refuses unknown fields)
then refuses the answer. The relay takes them out after the gateway has read what it
needs from them (usage, `kv_transfer_params`, `metrics`), and only touches an answer or a stream
event that holds one: a stream event is tested for them as bytes first (one regex search in C, so most
events are never parsed here); a non-streamed answer, parsed already, is looked at as a dict.

Tool-call endings
-----------------

Whether an engine's answer ended asking for tool calls: the boundary tool-boundary affinity
(`policies/routing/tool_affinity.py`) keeps a program's replica across.

Read from what the relay already holds (the parsed unary answer; each stream event's bytes), in the
three grammars an engine or a hosted provider answers in:

- chat completions: a choice's `finish_reason` is `tool_calls` (or the legacy `function_call`);
- Anthropic Messages: `stop_reason` is `tool_use`;
- Responses: an output item of type `function_call` (the model's turn ends there: the client must
  send the call's output back).

Streams are matched on bytes, not parsed: the relay does not parse every event, and these markers
appear only in the event that ends the answer (or announces a call), so a substring test per event
costs what `_FINISHED`'s does.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Protocol

import orjson
from aiohttp import web

from backends.types import EventBuffer, EventTooLarge, LoadTicket, answer_choices
from gateway.errors import InvalidRequest, UpstreamError, sse_error_event
from gateway.upstream.client import CallWatch, GatewayExhausted, Response, UpstreamClient, UpstreamConnectionError
from gateway.upstream.replica_loss import MAX_MIGRATIONS, Moving, Resume, sent_text
from policies.policy import client_body
from policies.types import ApiKind, Principal, Usage

# ---- The engine-control fields of the upstream body

NORMAL_PRIORITY = 0  # policies.schema.PRIORITY_VALUES["normal"]

# The output-limit fields each upstream API reads, the one the gateway writes when none is set last
# (chat: `max_tokens`, the one every engine knows; vLLM reads `max_completion_tokens` first when both
# are set, TensorRT-LLM's adapter maps it, so a client's `max_completion_tokens` is lowered in place).
OUTPUT_LIMIT_FIELDS: Mapping[str, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",),
}


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_min_tokens(body: Mapping[str, Any], max_tokens: int | None) -> None:
    """`min_tokens` (vLLM, TensorRT-LLM: generate at least that many) must be a count no larger
    than the request's output limit: a larger one asks for more output than may be produced (and
    than was reserved), so it is refused up front, naming the field, rather than by the engine."""
    if "min_tokens" not in body or body["min_tokens"] is None:
        return
    value = _count(body["min_tokens"])
    if value is None or value < 0:
        raise InvalidRequest("min_tokens: must be an integer >= 0", param="min_tokens")
    if max_tokens is not None and value > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({value}) must not be greater than the output limit ({max_tokens})", param="min_tokens"
        )


def choices(body: Mapping[str, Any]) -> int:
    """The number of choices a body asks for (`n`, 1 when absent or malformed)."""
    n = _count(body.get("n"))
    return n if n is not None and n > 0 else 1


def output_limit(reserved_tokens: int, body: Mapping[str, Any]) -> int:
    """The per-choice output limit that keeps `body`'s answer within `reserved_tokens` (for all of
    its choices); 0 when nothing was reserved (an API that generates nothing)."""
    if reserved_tokens <= 0:
        return 0
    return max(reserved_tokens // choices(body), 1)


def cap_output(body: dict[str, Any], api: ApiKind | str, limit: int, context_room: int | None = None) -> None:
    """Make `body` (the gateway's own copy) ask for at most `limit` output tokens per choice. A limit
    the gateway adds is also kept within `context_room` (the context the endpoint has left after the
    prompt) when known: an engine refuses a prompt + max_tokens beyond its context, where without
    the field it would have stopped at the context's end by itself."""
    fields = OUTPUT_LIMIT_FIELDS.get(api)
    if not fields or limit <= 0:
        return
    present = False
    for name in fields:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):  # _count, inlined: once per request
            present = True
            if value > limit:
                body[name] = limit
    if not present:
        body[fields[-1]] = min(limit, context_room) if context_room is not None and context_room > 0 else limit


def engine_body(
    body: dict[str, Any],
    principal: Principal,
    allowed: Collection[str],
    *,
    api: ApiKind | str | None = None,
    reserved_output_tokens: int = 0,
    context_room: int | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """A copy of `body` for the engine: control fields only from policy, priority from the tier, the
    output limit from the reservation (`api` names the fields) and the cache salt the gateway's."""
    shaped, _ = client_body(body, allowed)
    shaped = dict(shaped) if shaped is body else shaped
    if "priority" not in allowed or "priority" not in shaped:
        if principal.priority == NORMAL_PRIORITY:
            shaped.pop("priority", None)  # the engine's default: nothing to say
        else:
            shaped["priority"] = principal.priority
    if api is not None:
        cap_output(shaped, api, output_limit(reserved_output_tokens, shaped), context_room)
    if cache_salt is not None:
        shaped["cache_salt"] = cache_salt
    else:
        shaped.pop("cache_salt", None)  # only ever the gateway's (a trusted tenant's is folded into it)
    return shaped


# ---- The engine's own fields, out of the answer

# vLLM's own fields in its answers (vllm/entrypoints/openai/*/protocol.py, .../anthropic/protocol.py),
# none of them in the API's schema: a strict client refuses an answer that carries them. The transfer
# parameters (the gateway's prefill/decode business) and a chat or completions choice's `stop_reason`
# (the matched stop string; `finish_reason` says "stop") never reach the client; the others only when
# they hold something, which the client asked for with vLLM's own request fields (where the pool
# forwards them). `metrics` stays: an engine sends it only when its operator runs it with
# `--enable-per-request-metrics`. Only the top level and chat/completions choices are looked at: an
# Anthropic message's own `stop_reason` is its API's.
_ENGINE_ALWAYS = ("kv_transfer_params", "ec_transfer_params")
_ENGINE_UNASKED = ("prompt_logprobs", "prompt_token_ids", "prompt_text", "input_messages", "output_messages")
_CHOICE_ALWAYS = ("stop_reason",)
_CHOICE_UNASKED = ("token_ids", "routed_experts")
# a choice's message (or a chunk's delta): vLLM's `reasoning` (older versions: `reasoning_content`)
# holds the reasoning parser's output; empty, it is one more unknown field
_MESSAGE_UNASKED = ("reasoning", "reasoning_content")
_ENGINE_NAMES = (*_ENGINE_ALWAYS, *_ENGINE_UNASKED, *_CHOICE_ALWAYS, *_CHOICE_UNASKED, *_MESSAGE_UNASKED)
# any of the names as a JSON key ("name", quotes included): one pass of the regex engine over the
# event, where a substring test per name scanned it a dozen times (about 4x the time for an event)
_ENGINE_MARK = re.compile(b'"(?:' + b"|".join(re.escape(name.encode()) for name in _ENGINE_NAMES) + b')"')


def carries_engine_fields(data: bytes) -> bool:
    """Whether an answer or event may hold one of vLLM's own fields (as a quoted key, in C)."""
    return _ENGINE_MARK.search(data) is not None


def drop_engine_fields(answer: dict[str, Any]) -> bool:
    """Take vLLM's own fields out of a chat or completions answer or chunk, at the top and in each
    choice; whether anything was taken."""
    dropped = _drop(answer, _ENGINE_ALWAYS, _ENGINE_UNASKED)
    choices = answer.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            dropped = _drop(choice, _CHOICE_ALWAYS, _CHOICE_UNASKED) or dropped
            message = choice.get("message", choice.get("delta"))
            if isinstance(message, dict):
                dropped = _drop(message, (), _MESSAGE_UNASKED) or dropped
    return dropped


def _drop(node: dict[str, Any], always: tuple[str, ...], unasked: tuple[str, ...]) -> bool:
    dropped = False
    for name in always:
        if name in node:
            del node[name]
            dropped = True
    for name in unasked:
        if name in node and node[name] is None:
            del node[name]
            dropped = True
    return dropped


def without_engine_fields(event: bytes) -> bytes:
    """One `data:` event without vLLM's own fields (the event as it was when it holds none)."""
    try:
        chunk = orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return event
    if isinstance(chunk, dict) and drop_engine_fields(chunk):
        return b"data: " + orjson.dumps(chunk)
    return event


# ---- Whether the answer ended in tool calls

_TOOL_FINISH: Final = ("tool_calls", "function_call")
_MARKERS: Final = (
    b'"finish_reason":"tool_calls"',
    b'"finish_reason": "tool_calls"',
    b'"finish_reason":"function_call"',
    b'"stop_reason":"tool_use"',
    b'"stop_reason": "tool_use"',
    b'"type":"function_call"',
    b'"type": "function_call"',
)


def answer_calls_tools(body: Mapping[str, Any] | None) -> bool:
    """Whether a parsed (non-streamed) answer ends asking for tool calls."""
    if not body:
        return False
    choices = body.get("choices")
    if isinstance(choices, list):
        return any(isinstance(c, dict) and c.get("finish_reason") in _TOOL_FINISH for c in choices)
    if body.get("stop_reason") == "tool_use":
        return True
    output = body.get("output")
    if isinstance(output, list):
        return any(isinstance(item, dict) and item.get("type") == "function_call" for item in output)
    return False


def events_call_tools(events: Iterable[bytes]) -> bool:
    """Whether one of a stream's raw SSE events ends its answer in tool calls (or announces one)."""
    for event in events:
        # one cheap test before the exact markers
        if (b"_call" in event or b"tool_use" in event) and any(marker in event for marker in _MARKERS):
            return True
    return False


# ---- The call and the relay

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]"


class RetryableUpstream(Exception):
    """The upstream failed before anything reached the client: another endpoint may be tried."""

    def __init__(self, detail: str, *, status: int | None = None, body: bytes = b"", exhausted: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.body = body  # a 5xx's error body (bounded): what `engine_errors.engine_fault` reads
        self.exhausted = exhausted  # the gateway ran out of descriptors or buffers: no endpoint failed


class UpstreamRejected(Exception):
    """The upstream answered 4xx before streaming: relay its error to the client as it is."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body


@dataclass(slots=True)
class UpstreamTarget:
    url: str  # full URL, e.g. http://127.0.0.1:8001/v1/chat/completions
    headers: dict[str, str]
    body: bytes
    served_model: str
    public_model: str
    # the walk's handle on the call (gateway/upstream/replica_loss.py): cut when its replica stalls or its first-token
    # deadline passes; with a deadline armed a stream shows its client nothing before its first token
    watch: CallWatch | None = None


@dataclass(slots=True)
class RelayOutcome:
    status: int = 200
    usage: Usage | None = None
    counted_completion_tokens: int = 0
    first_token_at_s: float | None = None  # perf_counter
    last_token_at_s: float | None = None
    engine_metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    aborted: bool = False  # client went away before the answer was whole
    broken: bool = False  # upstream failed after the first byte
    done_sent: bool = False  # a stream's `data: [DONE]` was written: the client has the whole answer
    error_detail: str | None = None
    response: web.StreamResponse | None = None  # for non-streamed answers: not yet sent
    # called with first_token_at_s as the first token is relayed (the predictor learns of it then)
    on_first_token: Callable[[float], None] | None = field(default=None, repr=False)
    migrations: int = 0  # times the stream continued on another replica after its own cut it
    migrated_to: list[str] = field(default_factory=list)  # those replicas
    # a stream that can continue elsewhere: its upstream answer now (flow control may cut it to free
    # the slot for a tenant under its share: `preempt`), and whether that happened
    upstream: Response | None = field(default=None, repr=False)
    preempted: int = 0  # times flow control cut it (it waited its turn again, then continued)
    # a stream that failed over to a fallback model (gateway/transport/engine.py): the output tokens
    # its earlier legs sent, settled and recorded with them; `usage` and the counted tokens span the
    # whole stream, `leg_usage`/`leg_tokens` are the current leg's
    billed_tokens: int = 0
    # the caller's policy shows it the cost (`show_cost`): prices the final usage, which then carries
    # `cost_usd` (the figure settlement charges: `policies.policy.price_usd`); None: bodies as the API's own
    price: Callable[[Usage], float] | None = field(default=None, repr=False)
    # the answer ended asking for tool calls (gateway/upstream/relay.py): its program comes back
    tool_calls: bool = False
    # An engine the gateway fronts was sent the reservation as its output limit, and reads no prompt
    # past its context: it cannot produce or read more, so a usage report beyond these is bounded to
    # them where it is billed (`bound_usage`). 0: no bound (a hosted provider bills what it reports).
    output_cap: int = 0
    prompt_cap: int = 0
    _preempting: bool = field(default=False, repr=False)

    def bound_usage(self, output_tokens: int, max_model_len: int | None) -> None:
        """Bound the usage billed for this answer (see `output_cap`)."""
        self.output_cap = max(output_tokens, 0)
        self.prompt_cap = max(max_model_len or 0, 0)

    def leg_tokens(self) -> int:
        """Output tokens counted since the current leg began (the whole stream when it has one leg)."""
        return max(self.counted_completion_tokens - self.billed_tokens, 0)

    def bounded_usage(self) -> Usage | None:
        """`usage` within what the engine could have produced and read (`output_cap`, `prompt_cap`):
        what every reader that bills or weighs the answer reads (settlement, the record, fair shares)."""
        usage = self.usage
        if usage is None:
            return None
        if self.output_cap and usage.completion_tokens > self.output_cap:
            cap = self.output_cap
            usage = replace(usage, completion_tokens=cap, reasoning_tokens=min(usage.reasoning_tokens, cap))
        if self.prompt_cap and usage.prompt_tokens > self.prompt_cap:
            cap = self.prompt_cap
            usage = replace(usage, prompt_tokens=cap, cached_tokens=min(usage.cached_tokens, cap))
        return usage

    def leg_usage(self) -> Usage | None:
        """`bounded_usage` less what earlier legs were billed for (the stream's own usage reports their sum)."""
        usage = self.bounded_usage()
        if usage is None or not self.billed_tokens:
            return usage
        return replace(usage, completion_tokens=max(usage.completion_tokens - self.billed_tokens, 0))

    def preemptible(self) -> bool:
        """Whether flow control may cut this stream now: it can continue (a plain stream, its first
        token out, not moved before, not ending) and nothing asked already."""
        return (
            self.upstream is not None
            and not self._preempting
            and self.migrations == 0
            and self.first_token_at_s is not None
            and not self.done_sent
            and not self.aborted
            and not self.broken
        )

    def preempt(self) -> bool:
        """Cut the stream's upstream so that its slot frees now; the relay continues it after it
        waited its turn again (`gateway/upstream/replica_loss.py`). False when it cannot be cut."""
        if not self.preemptible():
            return False
        assert self.upstream is not None
        self._preempting = True
        self.upstream.close()  # the relay's read fails at once: a cut, continued as a preemption
        return True


def _usage_from(obj: Any) -> Usage | None:
    return Usage.from_chat(obj)


def _model_swap(target: UpstreamTarget) -> tuple[bytes, bytes] | None:
    if target.served_model == target.public_model:
        return None
    return (
        b'"model":' + orjson.dumps(target.served_model),
        b'"model":' + orjson.dumps(target.public_model),
    )


class StreamCodec(Protocol):
    """How the relay reads one API's stream (`gateway/apis/streams.py`): the bookkeeping of
    `relay_events` in that API's terms, and its own error event after the first byte."""

    def begin(self) -> bytes: ...

    def events(
        self, events: list[bytes], outcome: RelayOutcome, ticket: LoadTicket, swap: tuple[bytes, bytes] | None
    ) -> bytes: ...

    def broken(self, message: str) -> bytes: ...

    def end(self) -> bytes: ...


async def _hold(codec: StreamCodec) -> None:
    """Await what a codec must finish before its next bytes go out (a stored response)."""
    hold: Callable[[], Awaitable[None] | None] | None = getattr(codec, "hold", None)
    pending = hold() if hold is not None else None
    if pending is not None:
        await pending


async def _post(client: UpstreamClient, target: UpstreamTarget) -> Response:
    try:
        response = await client.post(target.url, target.headers, target.body, target.watch)
    except (UpstreamConnectionError, TimeoutError) as exc:
        raise RetryableUpstream(f"{type(exc).__name__}: {exc}", exhausted=isinstance(exc, GatewayExhausted)) from exc
    if response.status >= 500:
        try:
            raw = (await response.read())[:4096]
        except (UpstreamConnectionError, TimeoutError):
            raw = b""
        response.release()
        detail = raw[:300].decode("utf-8", "replace")
        raise RetryableUpstream(f"upstream answered {response.status}: {detail}", status=response.status, body=raw)
    if response.status != 200:
        try:
            body = await response.read()
        except (UpstreamConnectionError, TimeoutError) as exc:
            response.close()
            raise RetryableUpstream(f"{type(exc).__name__}: {exc}") from exc
        response.release()
        raise UpstreamRejected(response.status, body)
    return response


open_stream = _post  # a streamed call whose answer the caller reads (a stream's continuation)


async def _read_all(response: Response) -> bytes:
    try:  # `async with response` without its two coroutines: released however the read ends
        return await response.read()
    except (UpstreamConnectionError, TimeoutError) as exc:
        raise RetryableUpstream(f"{type(exc).__name__}: {exc}") from exc
    finally:
        response.release()


async def call_json(client: UpstreamClient, target: UpstreamTarget) -> dict[str, Any]:
    """A non-streamed call whose JSON answer the gateway itself consumes (e.g. a PD prefill leg)."""
    data = await _read_all(await _post(client, target))
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise RetryableUpstream("upstream answered invalid JSON") from exc
    if not isinstance(parsed, dict):
        raise RetryableUpstream("upstream answered a non-object JSON")
    return parsed


async def relay_unary(
    client: UpstreamClient,
    target: UpstreamTarget,
    ticket: LoadTicket,
    transform: Callable[[dict[str, Any]], tuple[bytes | None, Usage | None]] | None = None,
    price: Callable[[Usage], float] | None = None,
) -> RelayOutcome:
    """Forward a non-streamed request; the answer is returned, unsent, with its usage read.
    `transform` writes another API's answer (and reads its usage) from the parsed one; None for
    the body: the engine's bytes are already the answer (not encoded again). With `price` (the
    caller's policy shows it the cost) the answer's `usage` gains `cost_usd`."""
    data = await _read_all(await _post(client, target))
    now = time.perf_counter()
    outcome = RelayOutcome(first_token_at_s=now, last_token_at_s=now)
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise RetryableUpstream("upstream answered invalid JSON") from exc
    answer = parsed  # the client's answer as an object, while it is the parsed one
    outcome.tool_calls = isinstance(parsed, dict) and answer_calls_tools(parsed)
    if isinstance(parsed, dict) and transform is not None:
        written, outcome.usage = transform(parsed)
        if written is not None:
            data, answer = written, None
    elif isinstance(parsed, dict):
        outcome.usage = _usage_from(parsed.get("usage"))
        metrics = parsed.get("metrics")
        outcome.engine_metrics = metrics if isinstance(metrics, dict) else None
        renamed = target.served_model != target.public_model and "model" in parsed
        if renamed:
            parsed["model"] = target.public_model
        # the parsed answer is at hand: a few dict look-ups, not the byte scan a stream's events get
        if drop_engine_fields(parsed) or renamed:
            data = orjson.dumps(parsed)
    if price is not None and outcome.usage is not None:
        # opt-in: the translated answer is read back once more (only for callers shown their cost)
        data = with_cost(orjson.loads(data) if answer is None else answer, outcome.usage, price, data)
    ticket.first_token(outcome.usage.total_tokens if outcome.usage else 0)
    outcome.response = web.Response(body=data, content_type="application/json")
    return outcome


def with_cost(answer: Any, usage: Usage, price: Callable[[Usage], float], data: bytes) -> bytes:
    """`answer` encoded with `cost_usd` in its `usage` object (`data`, unchanged, when it has none).
    `cost_usd` rather than OpenRouter's `usage.cost`: the unit is in the name, as in the
    `x-tokenway-cost-usd` header and the ledger's field, and a client that reads OpenRouter's credits
    never mistakes it for them."""
    target = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(target, dict):
        return data
    target["cost_usd"] = cost_figure(price(usage))
    return orjson.dumps(answer)


def cost_figure(cost_usd: float) -> float:
    """The cost as every surface shows it: nano-dollar steps, like `x-tokenway-cost-usd`."""
    return round(cost_usd, 9)


def _has_output(payload: bytes) -> bool:
    """Whether one SSE data payload carries generated output (the first such marks TTFT)."""
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    for choice in answer_choices(chunk):  # none in a value that is not a chunk (`data: null`)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
                return True
        elif choice.get("text"):
            return True
        if choice.get("finish_reason"):
            return True
    return False


def _is_usage_chunk(event: bytes) -> bool:
    return (b'"usage":{' in event or b'"usage": {' in event) and (b'"choices":[]' in event or b'"choices": []' in event)


async def relay_stream(
    upstream_client: UpstreamClient,
    request: web.Request,
    target: UpstreamTarget,
    ticket: LoadTicket,
    outcome: RelayOutcome,
    *,
    client_wants_usage: bool,
    response_headers: list[tuple[str, str]],
    prompt_tokens: int,
    codec: StreamCodec | None = None,
    resume: Resume | None = None,
) -> None:
    """Relay an SSE stream to the client as it arrives, filling `outcome` as it goes.

    `outcome` is the caller's so that it stays readable when the client's disconnect cancels this
    coroutine: the caller accounts what was generated and re-raises. With `resume` (plain streams),
    a stream its replica cuts continues on another one, spliced in (`gateway/upstream/replica_loss.py`).
    """
    upstream = await _post(upstream_client, target)
    swap = _model_swap(target)
    client = web.StreamResponse(status=200, headers=SSE_HEADERS)
    for name, value in response_headers:
        client.headers[name] = value
    outcome.response = client
    pending = EventBuffer()  # the engine's events, whole (an event without its end is bounded)
    clean = False
    # a translated stream has a `resume` only where its codec reads chat chunks (a failover to a
    # fallback model: gateway/transport/engine.py): the splice happens before the codec reads them
    moving = Moving() if resume is not None else None
    preemptible = moving is not None and codec is None  # flow control cuts native streams only
    if preemptible:
        outcome.upstream = upstream
    current = ticket  # the load of the replica relaying now
    # a first-token deadline armed: the client sees nothing before the first token, so until then the
    # request can still move to another replica (`held` keeps what the engine sent before it)
    held: list[bytes] | None = [] if codec is None and target.watch is not None and target.watch.armed else None
    if held is None and target.watch is not None:
        target.watch.disarm()  # the client sees this stream from its head on: no deadline may cut it now
    try:
        if held is None:
            await client.prepare(request)
        if codec is not None:
            head = codec.begin()
            if head:
                await client.write(head)
        while True:
            cut: str | None = None
            events: list[bytes] = []
            if moving is not None and moving.error is not None:  # the engine sent an error event
                cut, moving.error = moving.error, None
            else:
                try:
                    data = await upstream.next_chunk()
                    if not data:
                        if moving is None or moving.finished:
                            break
                        cut = "the upstream ended the stream early"
                    else:
                        events = pending.feed(data)
                except (UpstreamConnectionError, TimeoutError, EventTooLarge) as exc:
                    cut = f"{type(exc).__name__}: {exc}"
            if cut is not None:
                if held is not None:  # the client has seen nothing: another replica may serve it
                    raise RetryableUpstream(cut)
                resumed = None
                preempted, outcome._preempting = outcome._preempting, False
                # a tool call already under way is never spliced: its deltas cannot be taken back
                if (
                    moving is not None
                    and resume is not None
                    and outcome.migrations < MAX_MIGRATIONS
                    and not moving.tool_calls
                ):
                    upstream.close()
                    current.end()  # its slot is free from now: routing and flow control see it
                    outcome.upstream = None
                    if preempted:
                        outcome.preempted += 1
                    text = sent_text(moving.sent, moving.api)
                    resumed = await resume(text, outcome.counted_completion_tokens, preempted)
                if resumed is None:
                    outcome.broken = True
                    outcome.error_detail = cut
                    message = f"the upstream stream failed: {cut}"
                    await client.write(codec.broken(message) if codec else sse_error_event(UpstreamError(message)))
                    break
                assert moving is not None
                upstream = resumed.response
                pending.clear()
                current = resumed.ticket
                if preemptible:
                    outcome.upstream = upstream
                moving.continued(resumed, outcome)
                if resumed.marker is not None:  # a fallback model continues it: the client is told where
                    marker = _failover_marker(codec, moving, resumed.marker)
                    if marker:
                        await client.write(marker)
                continue
            if not events:
                continue
            if not outcome.tool_calls:
                outcome.tool_calls = events_call_tools(events)
            if moving is not None:
                events = moving.relaying(events)
                if current is not ticket and not current.prefilled and _any_output(events):
                    current.first_token(current.prefill_tokens)  # the continuation's prompt is prefilled
            if codec is not None:
                out = codec.events(events, outcome, ticket, swap)
                await _hold(codec)
            else:
                out = relay_events(events, outcome, ticket, swap, client_wants_usage, prompt_tokens)
            if out and held is not None:
                held.append(out)
                if outcome.first_token_at_s is None:
                    continue
                out, held = b"".join(held), None
                await client.prepare(request)
            if out:
                await client.write(out)
                outcome.done_sent = outcome.done_sent or _DONE in out
        if held is not None:  # it ended without a token: what it sent goes out now
            out, held = b"".join(held), None
            await client.prepare(request)
            if out:
                await client.write(out)
                outcome.done_sent = outcome.done_sent or _DONE in out
        last = pending.rest()
        if last.strip() and not outcome.broken:
            if codec is not None:
                out = codec.events([last], outcome, ticket, swap)
            else:
                out = relay_events([last], outcome, ticket, swap, client_wants_usage, prompt_tokens)
            if out:
                await client.write(out)
                outcome.done_sent = outcome.done_sent or _DONE in out
        if codec is not None and not outcome.broken:
            tail = codec.end()
            await _hold(codec)
            if tail:
                await client.write(tail)
        await client.write_eof()
        clean = True
    except ConnectionResetError:  # the client went away (aiohttp's write error subclasses it)
        outcome.aborted = not outcome.done_sent  # after [DONE] it had the whole answer: served
    except asyncio.CancelledError:
        outcome.aborted = not outcome.done_sent
        raise
    finally:
        if not clean or outcome.broken:
            upstream.close()  # drop the connection: the engine sees the disconnect and aborts
        else:
            upstream.release()
        if moving is not None:
            moving.end()


def _failover_marker(codec: StreamCodec | None, moving: Moving, failover: dict[str, Any]) -> bytes:
    """The event that says where a stream moved to a fallback model, in the client's grammar: the
    codec's (`failover`, where it has one), else a chat or completions chunk (`Splice.marker`)."""
    if codec is not None:
        mark: Callable[[dict[str, Any]], bytes] | None = getattr(codec, "failover", None)
        return mark(failover) if mark is not None else b""
    assert moving.splice is not None
    return moving.splice.marker(failover)


def _any_output(events: list[bytes]) -> bool:
    return any(event.startswith(b"data:") and _has_output(event[5:]) for event in events)


def relay_events(
    events: list[bytes],
    outcome: RelayOutcome,
    ticket: LoadTicket,
    swap: tuple[bytes, bytes] | None,
    client_wants_usage: bool,
    prompt_tokens: int,
) -> bytes:
    """The bytes to send for complete SSE events, noting first token, usage and output count."""
    out: list[bytes] = []
    for event in events:
        if not event:
            continue
        if event.startswith(_DONE):
            out.append(event)
            continue
        if _is_usage_chunk(event):
            chunk = _read_usage_chunk(event, outcome)
            if not client_wants_usage:
                continue
            if chunk is not None:
                dropped = drop_engine_fields(chunk)  # parsed already: dict look-ups, no byte scan
                if outcome.price is not None and outcome.usage is not None:
                    event = b"data: " + with_cost(chunk, outcome.usage, outcome.price, event[5:].strip())
                elif dropped:
                    event = b"data: " + orjson.dumps(chunk)
        elif event.startswith(b"data:"):
            if carries_engine_fields(event):
                event = without_engine_fields(event)
            if outcome.first_token_at_s is None and _has_output(event[5:]):
                outcome.first_token_at_s = time.perf_counter()
                ticket.first_token(prompt_tokens)
                if outcome.on_first_token is not None:
                    outcome.on_first_token(outcome.first_token_at_s)
            if outcome.first_token_at_s is not None:
                outcome.counted_completion_tokens += 1
                outcome.last_token_at_s = time.perf_counter()
                ticket.inflight.last_token_s = time.monotonic()
        if swap is not None:
            event = event.replace(swap[0], swap[1], 1)
        out.append(event)
    if not out:
        return b""
    return b"\n\n".join(out) + b"\n\n"


def _read_usage_chunk(event: bytes, outcome: RelayOutcome) -> dict[str, Any] | None:
    """The usage chunk's usage (and engine extras) into `outcome`; the chunk, parsed."""
    try:
        chunk = orjson.loads(event[event.find(b"{") :])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(chunk, dict):
        return None
    outcome.usage = _usage_from(chunk.get("usage"))
    params = chunk.get("kv_transfer_params")
    if isinstance(params, dict):
        outcome.kv_transfer_params = params
    metrics = chunk.get("metrics")
    if isinstance(metrics, dict):
        outcome.engine_metrics = metrics
    return chunk

"""Upstream call and relay: one POST on the shared upstream client
(`gateway/upstream/client.py`), the answer passed back as received.

Streams are relayed event by event without re-serialising them: the only edits are a byte-level
swap of the `model` value (when the public name differs from the engine's) and dropping the usage
chunk the gateway asked for on the client's behalf. Errors before the first byte reach the caller as
`RetryableUpstream` (connect error, 5xx) so it can try another endpoint; after the first byte they
become one SSE error event and a clean end of stream. A client that goes away closes the upstream
connection at once (the engine aborts the request). A stream with a first-token deadline
(`gateway/upstream/stalls.py`) shows its client nothing before its first token, so a replica that stays silent
that long still fails "before the first byte" and the request moves to another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import orjson
from aiohttp import web

from backends.types import LoadTicket
from gateway.errors import UpstreamError, sse_error_event
from gateway.upstream.client import CallWatch, Response, UpstreamClient
from gateway.upstream.connection import UpstreamConnectionError
from gateway.upstream.engine_fields import carries_engine_fields, drop_engine_fields, without_engine_fields
from gateway.upstream.migrate import MAX_MIGRATIONS, Moving, Resume, sent_text
from gateway.upstream.tool_calls import answer_calls_tools, events_call_tools
from policies.types import Usage

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]"


class RetryableUpstream(Exception):
    """The upstream failed before anything reached the client: another endpoint may be tried."""

    def __init__(self, detail: str, *, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.body = body  # a 5xx's error body (bounded): what `engine_errors.engine_fault` reads


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
    # the walk's handle on the call (gateway/upstream/stalls.py): cut when its replica stalls or its first-token
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
    # a stream that failed over to a fallback model (gateway/transport/failover.py): the output tokens
    # its earlier legs sent, settled and recorded with them; `usage` and the counted tokens span the
    # whole stream, `leg_usage`/`leg_tokens` are the current leg's
    billed_tokens: int = 0
    # the caller's policy shows it the cost (`show_cost`): prices the final usage, which then carries
    # `cost_usd` (the figure settlement charges: `policies.policy.price_usd`); None: bodies as the API's own
    price: Callable[[Usage], float] | None = field(default=None, repr=False)
    # the answer ended asking for tool calls (gateway/upstream/tool_calls.py): its program comes back
    tool_calls: bool = False
    _preempting: bool = field(default=False, repr=False)

    def leg_tokens(self) -> int:
        """Output tokens counted since the current leg began (the whole stream when it has one leg)."""
        return max(self.counted_completion_tokens - self.billed_tokens, 0)

    def leg_usage(self) -> Usage | None:
        """`usage` less what earlier legs were billed for (the stream's own usage reports their sum)."""
        if self.usage is None or not self.billed_tokens:
            return self.usage
        return replace(self.usage, completion_tokens=max(self.usage.completion_tokens - self.billed_tokens, 0))

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
        waited its turn again (`gateway/upstream/migrate.py`). False when it cannot be cut."""
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
        raise RetryableUpstream(f"{type(exc).__name__}: {exc}") from exc
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
    for choice in chunk.get("choices") or ():
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
    a stream its replica cuts continues on another one, spliced in (`gateway/upstream/migrate.py`).
    """
    upstream = await _post(upstream_client, target)
    swap = _model_swap(target)
    client = web.StreamResponse(status=200, headers=SSE_HEADERS)
    for name, value in response_headers:
        client.headers[name] = value
    outcome.response = client
    pending = b""
    clean = False
    # a translated stream has a `resume` only where its codec reads chat chunks (a failover to a
    # fallback model: gateway/transport/failover.py): the splice happens before the codec reads them
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
            data = b""
            if moving is not None and moving.error is not None:  # the engine sent an error event
                cut, moving.error = moving.error, None
            else:
                try:
                    data = await upstream.next_chunk()
                    if not data:
                        if moving is None or moving.finished:
                            break
                        cut = "the upstream ended the stream early"
                except (UpstreamConnectionError, TimeoutError) as exc:
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
                upstream, pending = resumed.response, b""
                current = resumed.ticket
                if preemptible:
                    outcome.upstream = upstream
                moving.continued(resumed, outcome)
                if resumed.marker is not None:  # a fallback model continues it: the client is told where
                    marker = _failover_marker(codec, moving, resumed.marker)
                    if marker:
                        await client.write(marker)
                continue
            pending += data
            if b"\n\n" not in pending:
                continue
            *events, pending = pending.split(b"\n\n")
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
        if pending.strip() and not outcome.broken:
            if codec is not None:
                out = codec.events([pending], outcome, ticket, swap)
            else:
                out = relay_events([pending], outcome, ticket, swap, client_wants_usage, prompt_tokens)
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

"""Stream codecs for the Responses and Messages APIs: what the relay does with each upstream SSE
event instead of its chat-completions reading.

A codec does the relay's bookkeeping (first token, counted output, usage, last token time) in the
API's own terms and returns the bytes the client gets. Native codecs pass the engine's events
through as received (one byte-level model swap) and parse only the few that carry usage or end
the response; translating codecs parse chat chunks and write the API's events
(`backends.protocols`). A failure after the first byte ends the stream with the API's own error
event (`response.failed` / an `error` event), never a chat-shaped one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

import orjson

from backends.protocols import anthropic, split_event, typed_event
from backends.protocols.responses import ResponsesStream
from backends.types import LoadTicket, answer_choices, object_field, usage_count
from gateway.upstream.relay import RelayOutcome, cost_figure
from policies.types import Usage

_DONE = b"data: [DONE]"


class StreamCodec(Protocol):
    """The relay's per-API reading of an SSE stream (`relay_stream(codec=...)`)."""

    def begin(self) -> bytes: ...

    def events(
        self, events: list[bytes], outcome: RelayOutcome, ticket: LoadTicket, swap: tuple[bytes, bytes] | None
    ) -> bytes: ...

    def broken(self, message: str) -> bytes: ...

    def end(self) -> bytes: ...


def _output(outcome: RelayOutcome, ticket: LoadTicket, reserved_tokens: int, tokens: int = 1) -> None:
    """One event of generated output: TTFT on the first, counted tokens and last-token time."""
    now = time.perf_counter()
    if outcome.first_token_at_s is None:
        outcome.first_token_at_s = now
        ticket.first_token(reserved_tokens)
        if outcome.on_first_token is not None:
            outcome.on_first_token(now)
    outcome.counted_completion_tokens += tokens
    outcome.last_token_at_s = now
    ticket.inflight.last_token_s = time.monotonic()


def _show_cost(usage: Any, outcome: RelayOutcome) -> None:
    """`cost_usd` into the final usage object, for a caller whose policy shows it (`outcome.price`)."""
    if outcome.price is not None and outcome.usage is not None and type(usage) is dict:
        usage["cost_usd"] = cost_figure(outcome.price(outcome.usage))


def responses_usage(usage: Any) -> Usage | None:
    # parsed JSON: objects are dicts (an exact type check, not the ABC's slower one)
    if type(usage) is not dict:
        return None
    details = usage.get("input_tokens_details")
    return Usage(
        prompt_tokens=usage_count(usage.get("input_tokens")),
        completion_tokens=usage_count(usage.get("output_tokens")),
        cached_tokens=usage_count(details.get("cached_tokens")) if type(details) is dict else 0,
    )


def messages_usage(usage: Any) -> Usage | None:
    """Anthropic counts cached prompt tokens apart: the prompt is their sum."""
    if type(usage) is not dict:
        return None
    cached = usage_count(usage.get("cache_read_input_tokens"))
    prompt = usage_count(usage.get("input_tokens")) + cached + usage_count(usage.get("cache_creation_input_tokens"))
    return Usage(prompt_tokens=prompt, completion_tokens=usage_count(usage.get("output_tokens")), cached_tokens=cached)


class NativeResponses:
    """An engine's own /v1/responses stream, relayed as is but for the response's id (the gateway's
    own, `response_id`, in every event that carries the response); the final response is kept (to
    store)."""

    _OUTPUT = (b"response.output_text.delta", b"response.function_call_arguments.delta", b"response.refusal.delta")
    _FINAL = (b"response.completed", b"response.incomplete", b"response.failed")
    _OPENING = (b"response.created", b"response.in_progress", b"response.queued")

    def __init__(self, reserved_tokens: int, previous_response_id: str | None, response_id: str) -> None:
        self.reserved_tokens = reserved_tokens
        self.previous = previous_response_id
        self.response_id = response_id
        self.final: dict[str, Any] | None = None
        self.seq = 0

    def begin(self) -> bytes:
        return b""

    def events(
        self, events: list[bytes], outcome: RelayOutcome, ticket: LoadTicket, swap: tuple[bytes, bytes] | None
    ) -> bytes:
        out: list[bytes] = []
        for event in events:
            if not event:
                continue
            head = event[:64]
            if any(kind in head for kind in self._OUTPUT):
                _output(outcome, ticket, self.reserved_tokens)
            elif any(kind in head for kind in self._FINAL):
                event = self._final(event, outcome, swap)
            elif any(kind in head for kind in self._OPENING):
                event = self._opening(event, swap)
            elif swap is not None:
                event = event.replace(swap[0], swap[1], 1)
            out.append(event)
            self.seq += 1
        return b"\n\n".join(out) + b"\n\n" if out else b""

    def _response_of(
        self, event: bytes, swap: tuple[bytes, bytes] | None
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The event's payload and its `response` object, already under the gateway's id and the public
        model; None when the event carries no response object (it is then relayed as it came)."""
        _name, data = split_event(event)
        try:
            payload = orjson.loads(data or b"")
        except orjson.JSONDecodeError:
            return None
        response = payload.get("response") if isinstance(payload, dict) else None
        if not isinstance(response, dict):
            return None
        response["id"] = self.response_id
        if swap is not None:
            response["model"] = orjson.loads(swap[1][len(b'"model":') :])
        return payload, response

    def _opening(self, event: bytes, swap: tuple[bytes, bytes] | None) -> bytes:
        """`response.created` / `.in_progress`: the response, still without output, under its id."""
        parsed = self._response_of(event, swap)
        if parsed is None or "type" not in parsed[0]:
            return event
        return typed_event(parsed[0]).rstrip(b"\n")

    def _final(self, event: bytes, outcome: RelayOutcome, swap: tuple[bytes, bytes] | None) -> bytes:
        """Usage from the last event; its response gets the public model and the real previous id."""
        parsed = self._response_of(event, swap)
        if parsed is None:
            return event
        payload, response = parsed
        outcome.usage = responses_usage(response.get("usage"))
        _show_cost(response.get("usage"), outcome)
        if self.previous is not None:
            response["previous_response_id"] = self.previous
        self.final = response
        return typed_event(payload)

    def broken(self, message: str) -> bytes:
        return typed_event(
            {"type": "error", "code": "upstream_error", "message": message, "param": None, "sequence_number": self.seq}
        )

    def end(self) -> bytes:
        return b""


class NativeMessages:
    """An engine's own /v1/messages stream, relayed as is."""

    def __init__(self, reserved_tokens: int) -> None:
        self.reserved_tokens = reserved_tokens
        self.prompt = Usage()

    def begin(self) -> bytes:
        return b""

    def events(
        self, events: list[bytes], outcome: RelayOutcome, ticket: LoadTicket, swap: tuple[bytes, bytes] | None
    ) -> bytes:
        out: list[bytes] = []
        for event in events:
            if not event:
                continue
            head = event[:48]
            if b"content_block_delta" in head:
                _output(outcome, ticket, self.reserved_tokens)
            elif b"message_delta" in head or b"message_start" in head:
                event = self._usage(event, outcome)
            if swap is not None and b"message_start" in head:
                event = event.replace(swap[0], swap[1], 1)
            out.append(event)
        return b"\n\n".join(out) + b"\n\n" if out else b""

    def _usage(self, event: bytes, outcome: RelayOutcome) -> bytes:
        """Usage from `message_start` / `message_delta`; the event as it goes out (with `cost_usd` in
        `message_delta`'s usage for a caller shown its cost)."""
        _name, data = split_event(event)
        try:
            payload = orjson.loads(data or b"")
        except orjson.JSONDecodeError:
            return event
        if not isinstance(payload, dict):
            return event
        if payload.get("type") == "message_start":
            message = payload.get("message")
            usage = messages_usage(message.get("usage") if isinstance(message, dict) else None)
            if usage is not None:
                self.prompt = usage
            return event
        usage = messages_usage(payload.get("usage"))
        if usage is not None:
            prompt = usage.prompt_tokens or self.prompt.prompt_tokens  # message_delta may carry output only
            cached = usage.cached_tokens or self.prompt.cached_tokens
            outcome.usage = Usage(prompt_tokens=prompt, completion_tokens=usage.completion_tokens, cached_tokens=cached)
            if outcome.price is not None:
                _show_cost(payload["usage"], outcome)
                return typed_event(payload).rstrip(b"\n")
        return event

    def broken(self, message: str) -> bytes:
        return typed_event(anthropic.error_body(500, message, kind="api_error"))

    def end(self) -> bytes:
        return b""


class _FromChat:
    """Chat chunks from the engine, parsed; the API's events to the client."""

    def __init__(self, reserved_tokens: int) -> None:
        self.reserved_tokens = reserved_tokens
        self.started = False

    def _feed(self, chunk: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def begin(self) -> bytes:
        return b""

    def events(
        self, events: list[bytes], outcome: RelayOutcome, ticket: LoadTicket, swap: tuple[bytes, bytes] | None
    ) -> bytes:
        out = b""
        for event in events:
            if not event.startswith(b"data:") or event.startswith(_DONE):
                continue
            try:
                chunk = orjson.loads(event[5:])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(chunk, dict):
                continue
            if chunk.get("usage") and not chunk.get("choices"):
                outcome.usage = Usage.from_chat(chunk["usage"])
                if type(chunk["usage"]) is dict:  # the translation carries `cost_usd` over, when set here
                    chunk["usage"].pop("cost_usd", None)  # never an upstream's own figure
                    _show_cost(chunk["usage"], outcome)
            for choice in answer_choices(chunk):
                delta = object_field(choice, "delta")
                if delta.get("content") or delta.get("tool_calls"):
                    _output(outcome, ticket, self.reserved_tokens)
            out += self._feed(chunk)
        return out


class ResponsesFromChat(_FromChat):
    def __init__(
        self,
        request: Mapping[str, Any],
        model: str,
        reserved_tokens: int,
        previous_response_id: str | None,
        response_id: str,
    ) -> None:
        super().__init__(reserved_tokens)
        self.stream = ResponsesStream({**request, "previous_response_id": previous_response_id}, model, response_id)

    @property
    def final(self) -> dict[str, Any] | None:
        return self.stream.response if self.stream.ended and self.stream.response["status"] != "failed" else None

    def begin(self) -> bytes:
        return self.stream.start()

    def _feed(self, chunk: dict[str, Any]) -> bytes:
        return self.stream.feed(chunk)

    def broken(self, message: str) -> bytes:
        return self.stream.fail(message, "upstream_error")

    def failover(self, marker: Mapping[str, Any]) -> bytes:
        """Where the stream moved to a fallback model (gateway/transport/engine.py): an event of
        tokenway's own type in the stream's sequence; the response goes on under its id, one
        `response.created`, the text in the same output item."""
        return self.stream.extension({"type": "tokenway.failover", "tokenway": {"failover": dict(marker)}})

    def end(self) -> bytes:
        return b"" if self.stream.ended else self.stream.finish()


class MessagesFromChat(_FromChat):
    def __init__(self, request: Mapping[str, Any], model: str, reserved_tokens: int, prompt_tokens: int) -> None:
        super().__init__(reserved_tokens)
        self.stream = anthropic.MessagesStream(request, model)
        self.prompt_tokens = prompt_tokens

    def begin(self) -> bytes:
        return self.stream.start(self.prompt_tokens)

    def _feed(self, chunk: dict[str, Any]) -> bytes:
        return self.stream.feed(chunk)

    def broken(self, message: str) -> bytes:
        return self.stream.fail(message)

    def failover(self, marker: Mapping[str, Any]) -> bytes:
        """Where the stream moved to a fallback model (gateway/transport/engine.py): a `ping` event
        (Anthropic's grammar has no extension event; its SDKs skip pings) carrying `tokenway.failover`;
        the message goes on with one `message_start` and its open text block."""
        return typed_event({"type": "ping", "tokenway": {"failover": dict(marker)}})

    def end(self) -> bytes:
        return b"" if self.stream.ended else self.stream.finish()

"""Streams that survive their replica: a stream cut mid-way continues on another replica of the pool.

tokenway relays every token, so when a replica dies mid-stream (or a scale-down drain must stop it
before its streams end) it can do what ServerlessLLM (OSDI '24) does for live migration without the
engine's help: send the original prompt plus the text generated so far to another replica, which
recomputes the KV cache of that prefix and generates the rest, and splice the continuation into the
client's stream:

- chat: the messages plus `{"role": "assistant", "content": <text so far>}` with vLLM's
  `continue_final_message: true, add_generation_prompt: false`; completions: prompt + text so far;
  `max_tokens` (or `max_completion_tokens`) less the tokens already sent;
- the continuation's events carry the original stream's `id` and `created`, its opening role-only
  chunk is dropped, and its usage chunk is rewritten: prompt tokens are the original prompt's (the
  recomputed prefix is billed neither as input nor as output), completion tokens are those sent
  before the cut plus the continuation's. The client sees one stream and is billed once.

Sampling may differ after the splice (another replica, another random state; a seed does not carry
over). Only plain text streams move: one choice, no tools, no logprobs, no structured output; others
end with the error event as before. A cut is a reset, a body that ends without a finish, or an error
event from the engine (`data: {"error": ...}`: nothing after it is relayed). The same continuation and
splice carry a stream to a fallback model (`gateway/transport/failover.py`), whose chunks then carry
its name and a marker (`Splice.marker`). `Splice` and the body builders are pure; `relay_stream`
calls the `Resume` the walk gives it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import orjson

from backends.types import Endpoint, LoadTicket
from gateway.upstream.client import Response

if TYPE_CHECKING:
    from gateway.upstream.relay import RelayOutcome

MAX_MIGRATIONS: Final = 2  # continuations per stream (a second cut moves it again, then it ends)
_BLOCKING_FIELDS: Final = ("tools", "functions", "logprobs", "top_logprobs", "response_format", "guided_json")


@dataclass(slots=True)
class Resumed:
    """A continuation under way: its upstream answer, its load ticket, what the splice needs."""

    response: Response
    ticket: LoadTicket
    endpoint_id: str
    prompt_tokens: int  # the original request's, as billed
    api: str  # chat | completions
    # a failover to a fallback model (gateway/transport/failover.py): its public name, which the
    # continuation's chunks carry, and the marker event that tells the client where the switch was
    model: str | None = None
    marker: dict[str, Any] | None = None


# (text sent so far, completion tokens sent so far, whether flow control cut it to free its slot)
# -> a continuation on another replica (or, after a preemption, wherever its turn finds room), or None
Resume = Callable[[str, int, bool], Awaitable[Resumed | None]]
# a preempted stream's wait for its turn in its pool's waiting room: the endpoint to continue on, or
# None when the wait ended without one (its deadline, the room full)
WaitTurn = Callable[[], Awaitable[Endpoint | None]]


def can_migrate(body: Mapping[str, Any], api: str) -> bool:
    """Whether a stream of this request can be continued elsewhere (plain text, one choice)."""
    if api not in ("chat", "completions"):
        return False
    if (body.get("n") or 1) != 1 or body.get("echo") or body.get("best_of"):
        return False
    return not any(body.get(name) for name in _BLOCKING_FIELDS)


def can_fail_over(body: Mapping[str, Any], api: str) -> bool:
    """Whether a stream of this request can continue on a fallback model: as `can_migrate`, but tools
    are allowed (a stream whose tool-call deltas already went out is never continued: the relay's
    `Moving.tool_calls`), since the new leg starts any call of its own from scratch."""
    if api not in ("chat", "completions"):
        return False
    if (body.get("n") or 1) != 1 or body.get("echo") or body.get("best_of"):
        return False
    return not any(body.get(name) for name in _BLOCKING_FIELDS if name not in ("tools", "functions"))


def continuation_body(body: Mapping[str, Any], api: str, text: str, sent_tokens: int) -> dict[str, Any] | None:
    """The request that continues `body` after `text` (`sent_tokens` of output); None when nothing
    is left to generate (the budget is spent) or the request cannot be continued."""
    out = dict(body)
    for name in ("max_tokens", "max_completion_tokens"):
        limit = body.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            left = limit - sent_tokens
            if left <= 0:
                return None
            out[name] = left
    if not text:
        return out  # nothing was sent yet: the same request again
    if api == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        out["messages"] = [*messages, {"role": "assistant", "content": text}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        out["prompt"] = prompt + text
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        out["min_tokens"] = max(min_tokens - sent_tokens, 0)
    return out


def sent_text(events: Sequence[bytes], api: str) -> str:
    """The text the relayed events carried (their deltas in order)."""
    parts: list[str] = []
    for event in events:
        if not event.startswith(b"data:") or event.startswith(b"data: [DONE]"):
            continue
        try:
            chunk = orjson.loads(event[5:])
        except orjson.JSONDecodeError:
            continue
        for choice in chunk.get("choices") or ():
            if api == "chat":
                delta = choice.get("delta") or {}
                content = delta.get("content") if isinstance(delta, dict) else None
            else:
                content = choice.get("text")
            if isinstance(content, str):
                parts.append(content)
    return "".join(parts)


def stream_identity(event: bytes) -> tuple[str, int] | None:
    """(id, created) of a stream's chunk."""
    try:
        chunk = orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(chunk, dict) or not isinstance(chunk.get("id"), str):
        return None
    created = chunk.get("created")
    return chunk["id"], created if isinstance(created, int) else 0


class Splice:
    """Rewrites a continuation's events so that they read as the original stream's (module doc)."""

    def __init__(
        self,
        identity: tuple[str, int] | None,
        sent_tokens: int,
        prompt_tokens: int,
        api: str,
        model: str | None = None,
    ) -> None:
        self.identity = identity
        self.sent_tokens = sent_tokens
        self.prompt_tokens = prompt_tokens
        self.api = api
        self.model = model  # a fallback model's continuation: its chunks name it (None: as the engine wrote)
        self._opened = False

    def events(self, events: Sequence[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for event in events:
            if not event or not event.startswith(b"data:") or event.startswith(b"data: [DONE]"):
                out.append(event)
                continue
            try:
                chunk = orjson.loads(event[5:])
            except orjson.JSONDecodeError:
                out.append(event)
                continue
            if not isinstance(chunk, dict):
                out.append(event)
                continue
            if self.identity is not None:
                chunk["id"], chunk["created"] = self.identity
            if self.model is not None and "model" in chunk:
                chunk["model"] = self.model
            usage = chunk.get("usage")
            if isinstance(usage, dict) and not chunk.get("choices"):
                chunk["usage"] = self._usage(usage)
            elif not self._opened and self._role_only(chunk):
                self._opened = True
                continue
            else:
                self._opened = True
                if isinstance(usage, dict):  # continuous usage stats: the spliced totals
                    chunk["usage"] = self._usage(usage)
            out.append(b"data: " + orjson.dumps(chunk))
        return out

    def marker(self, failover: Mapping[str, Any]) -> bytes:
        """The chunk that tells a chat or completions client where its stream moved to a fallback model:
        the stream's id and created, no choices, and the extension object `tokenway.failover`
        (OpenAI's clients keep unknown fields and read a chunk without choices as they read the usage one)."""
        identity = self.identity or ("", 0)
        chunk: dict[str, Any] = {
            "id": identity[0],
            "object": "chat.completion.chunk" if self.api == "chat" else "text_completion",
            "created": identity[1],
            "model": self.model or "",
            "choices": [],
            "tokenway": {"failover": dict(failover)},
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _usage(self, usage: Mapping[str, Any]) -> dict[str, Any]:
        completion = int(usage.get("completion_tokens") or 0) + self.sent_tokens
        fixed = dict(usage)
        fixed["prompt_tokens"] = self.prompt_tokens
        fixed["completion_tokens"] = completion
        fixed["total_tokens"] = self.prompt_tokens + completion
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            fixed["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], self.prompt_tokens),
            }
        return fixed

    def _role_only(self, chunk: Mapping[str, Any]) -> bool:
        """The continuation's opening chunk: a role and no content (the client already had one)."""
        choices = chunk.get("choices") or []
        if not isinstance(choices, list) or len(choices) != 1 or self.api != "chat":
            return False
        delta = choices[0].get("delta") or {}
        return bool(delta.get("role")) and not delta.get("content") and not choices[0].get("finish_reason")


@dataclass(slots=True)
class Resumer:
    """The `Resume` of one stream: where its continuation goes and how it is sent.

    `route(avoid)` picks another ready endpoint of the stream's pool (the router, as for any
    request, minus the endpoints that cut it); `send(endpoint, body)` opens the continuation there
    (the dispatch's body shaping, headers and upstream client); `RetryableUpstream`-style failures
    surface as a None answer, and the next endpoint is tried (twice at most). A pool whose other
    replicas are all out of routing at the moment of the cut (a health probe that timed out on a busy
    host, a replica still starting) is asked again for up to `wait_s` while `others(avoid)` says
    the pool has an endpoint left to try: the client's stream stalls for that long instead of ending
    with the error event.

    A stream flow control cut to free its slot (`RelayOutcome.preempt`) is not avoiding a broken
    replica: it waits its turn in the pool's waiting room (`wait_turn`, in flow order like any
    request) and continues wherever that finds room, its own replica included."""

    body: Mapping[str, Any]
    api: str
    prompt_tokens: int
    first_endpoint: str
    route: Callable[[frozenset[str]], Endpoint | None]
    send: Callable[[Endpoint, dict[str, Any]], Awaitable[Response | None]]
    others: Callable[[frozenset[str]], bool] = lambda avoid: False
    wait_turn: WaitTurn | None = None
    avoid: set[str] = field(default_factory=set)
    wait_s: float = 10.0
    poll_s: float = 0.2

    async def __call__(self, text: str, sent_tokens: int, preempted: bool = False) -> Resumed | None:
        body = continuation_body(self.body, self.api, text, sent_tokens)
        if body is None:
            return None
        if preempted and self.wait_turn is not None:
            endpoint = await self.wait_turn()
            if endpoint is None:
                return None  # its wait ended without a turn (the band's deadline): it ends here
            resumed = await self._send(endpoint, body, sent_tokens)
            if resumed is not None:
                return resumed
            self.avoid.add(endpoint.id)  # it failed there: on to another replica, as for a cut
        else:
            self.avoid.add(self.first_endpoint)
        for _ in range(2):
            endpoint = await self._routed()
            if endpoint is None:
                return None
            self.avoid.add(endpoint.id)
            resumed = await self._send(endpoint, body, sent_tokens)
            if resumed is not None:
                return resumed
        return None

    async def _send(self, endpoint: Endpoint, body: dict[str, Any], sent_tokens: int) -> Resumed | None:
        # the continuation's prompt (the original and what was sent) stays a pending prefill there until
        # its first new token is relayed (the relay releases it): the answer's headers come before it
        ticket = endpoint.inflight.begin(self.prompt_tokens + sent_tokens)
        response = await self.send(endpoint, body)
        if response is None:
            ticket.end()
            return None
        return Resumed(response, ticket, endpoint.id, self.prompt_tokens, self.api)

    async def _routed(self) -> Endpoint | None:
        deadline = time.monotonic() + self.wait_s
        while True:
            endpoint = self.route(frozenset(self.avoid))
            if endpoint is not None or time.monotonic() >= deadline or not self.others(frozenset(self.avoid)):
                return endpoint
            await asyncio.sleep(self.poll_s)


_FINISHED = (b'"finish_reason":"', b'"finish_reason": "', b"data: [DONE]")


class Moving:
    """A stream's migration state: what was sent (to continue after it), whether it finished, the
    splice of the continuation under way and its load tickets."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.finished = False
        self.identity: tuple[str, int] | None = None
        self.splice: Splice | None = None
        self.api = "chat"
        self.tickets: list[LoadTicket] = []
        self.tool_calls = False  # a tool-call delta went out: the stream is not continued elsewhere
        self.error: str | None = None  # the engine sent an error event: a cut, as a reset is

    def relaying(self, events: list[bytes]) -> list[bytes]:
        if self.splice is not None:
            events = self.splice.events(events)
        for position, event in enumerate(events):
            if not event.startswith(b"data:"):
                continue
            if event.startswith(b'data: {"error"') or event.startswith(b'data:{"error"'):
                # what follows it (a [DONE]) is not the answer's end: the stream failed here
                self.error = f"the engine sent an error event: {event[5:305].decode('utf-8', 'replace').strip()}"
                return events[:position]
            if not self.tool_calls and b'"tool_calls"' in event and _tool_call_delta(event):
                self.tool_calls = True
            if any(marker in event for marker in _FINISHED):
                self.finished = True
            if self.identity is None and not event.startswith(b"data: [DONE]"):
                self.identity = stream_identity(event)
                if b'"object":"text_completion"' in event or b'"object": "text_completion"' in event:
                    self.api = "completions"
            self.sent.append(event)
        return events

    def continued(self, resumed: Resumed, outcome: RelayOutcome) -> None:
        self.splice = Splice(
            self.identity, outcome.counted_completion_tokens, resumed.prompt_tokens, resumed.api, resumed.model
        )
        self.api = resumed.api
        self.tickets.append(resumed.ticket)
        outcome.migrations += 1
        outcome.migrated_to.append(resumed.endpoint_id)

    def end(self) -> None:
        for ticket in self.tickets:
            ticket.end()


def _tool_call_delta(event: bytes) -> bool:
    """Whether a chat chunk carries a tool-call delta (a non-empty `tool_calls`)."""
    try:
        chunk = orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return False
    for choice in chunk.get("choices") or () if isinstance(chunk, dict) else ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and delta.get("tool_calls"):
            return True
    return False

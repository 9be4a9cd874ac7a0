"""A replica lost under a request: a frozen one found and cut (stalls), a stream cut mid-way
continued on another replica (migration).

Both decide what a request does when its replica stops serving it without a clean error: the stall
watch notices a replica that went silent and cuts its calls; a call cut before its client saw a byte
moves like any failed attempt, and a stream cut after continues elsewhere when it can. One module
because the cut and the continuation are two halves of that decision.

Frozen engines
--------------

First-token deadlines and stalled replicas out of routing.

An engine can stop without failing: a process stopped (`SIGSTOP`, a debugger, a swapped-out host), a
hung GPU or collective. It still accepts connections (the kernel's backlog), so nothing errors, and
without a deadline every request routed to it waits for the read timeout while its peers idle.

Two defences, both on what the gateway relays itself:

- **First-token deadline** (per request, `server.first_token_deadline`). A stream that has shown its
  client nothing when the deadline passes is cut on its replica (the engine sees the disconnect and
  aborts) and sent to another, as a failure before the first byte is: the attempt is not charged, the
  request keeps one reservation and leaves one record. The deadline is `factor` x the predictor's
  TTFT p90 for the chosen replica (`default_s` without one), clamped to [`min_s`, `max_s`], and armed
  only while another replica may take the request: the last try waits as long as the engine takes. A
  non-streamed answer shows nothing until it is whole, so it has no first-token deadline.
- **Stalled replica** (per endpoint, `server.stall_after_s`). A replica with requests in flight
  for that long, none of which received a byte for that long (no token, no answer, no head), is
  stalled when one of them is a stream (a live engine sends tokens) or when its metrics stopped
  answering too (only non-streamed work in flight: a long generation shows no byte either, a live
  engine still answers `/metrics`). So is a replica that misses `misses_to_stall` first-token
  deadlines in a row with no sign of life in between (a busy replica relays tokens for others between
  misses). A stalled replica is ejected (backends/fleet.py: capped like every ejection, it returns
  through the half-open health probe) and every call on it is cut: a request that showed its client
  nothing moves to another replica; a stream that did continues there when it can
  (below), else ends with an error event instead of hanging.

Streams that survive their replica
----------------------------------

A stream cut mid-way continues on another replica of the pool.

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
splice carry a stream to a fallback model (`gateway/transport/engine.py`), whose chunks then carry
its name and a marker (`Splice.marker`). `Splice` and the body builders are pure; `relay_stream`
calls the `Resume` the walk gives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import orjson

from backends.config import EjectionSettings
from backends.fleet import Fleet, eject_capped
from backends.types import Endpoint, EndpointState, LoadTicket, answer_choices, object_field, usage_count
from gateway.app.settings import FirstTokenDeadline
from gateway.upstream.client import CallWatch, Response
from predictor.features import Prediction

if TYPE_CHECKING:
    from gateway.upstream.relay import RelayOutcome


# ---- Frozen engines: deadlines and stall verdicts

log = logging.getLogger("tokenway.stalls")

DEADLINE = "first-token deadline"
STALLED = "replica stalled"


class StallWatch:
    """The calls in flight per endpoint, their deadlines, and the stall verdicts over them."""

    def __init__(
        self,
        fleet: Fleet,
        deadline: FirstTokenDeadline,
        stall_after_s: float,
        ejection: EjectionSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.deadline = deadline
        self.stall_after_s = stall_after_s
        self.ejection = ejection
        self.clock = clock
        self._calls: dict[str, tuple[Endpoint, set[CallWatch]]] = {}
        self._misses: dict[str, tuple[int, float]] = {}  # endpoint id -> (misses in a row, first one's time)
        self.stalls = 0  # stall verdicts so far (/admin, tests)

    # -- the walk's side
    def begin(self, endpoint: Endpoint, *, stream: bool) -> CallWatch:
        watch = CallWatch(endpoint.id, stream=stream, now_s=self.clock())
        entry = self._calls.get(endpoint.id)
        if entry is None or entry[0] is not endpoint:
            entry = self._calls[endpoint.id] = (endpoint, set())
        entry[1].add(watch)
        return watch

    def end(self, watch: CallWatch) -> None:
        watch.disarm()
        entry = self._calls.get(watch.endpoint_id)
        if entry is not None:
            entry[1].discard(watch)

    def deadline_s(self, prediction: Prediction | None) -> float:
        """The first-token deadline for a request with this prediction of its replica."""
        d = self.deadline
        base = d.default_s if prediction is None else d.factor * max(prediction.ttft_p90_ms, 0.0) / 1000.0
        return min(max(base, d.min_s), d.max_s)

    def arm(self, watch: CallWatch, prediction: Prediction | None) -> None:
        if self.deadline.enabled:
            watch.arm(self.deadline_s(prediction), DEADLINE)

    def missed_first_token(self, endpoint: Endpoint) -> None:
        """A call on `endpoint` was cut by its first-token deadline."""
        now = self.clock()
        count, first = self._misses.get(endpoint.id, (0, now))
        if count and self._last_life(endpoint) > first:
            count, first = 0, now  # it relayed something since: busy, not frozen
        count += 1
        self._misses[endpoint.id] = (count, first if count > 1 else now)
        if count >= self.deadline.misses_to_stall:
            self._stalled(endpoint, now, f"{count} first-token deadlines missed with no output between them")

    # -- the background side
    def check(self) -> None:
        """One pass over the endpoints with calls in flight: stall verdicts."""
        now = self.clock()
        after = self.stall_after_s
        for endpoint, all_calls in list(self._calls.values()):
            calls = [c for c in all_calls if not c.reason]  # those cut already are ending (or continue elsewhere)
            if not calls:
                continue
            if now - min(c.started_s for c in calls) < after or now - self._last_life(endpoint) < after:
                continue
            scraped = endpoint.stats.scraped_at_s
            metrics_silent = scraped > 0.0 and now - scraped >= after
            if any(c.stream for c in calls) or metrics_silent:
                self._stalled(endpoint, now, f"no byte from it for {after:g}s with {len(calls)} requests in flight")

    async def run(self) -> None:
        """`check` until cancelled, a few times per `stall_after_s`."""
        tick_s = min(0.5, self.stall_after_s / 4)
        while True:
            await asyncio.sleep(tick_s)
            try:
                self.check()
            except Exception:  # a bug here must not end the watch
                log.exception("stall check failed")

    # -- verdicts
    def _last_life(self, endpoint: Endpoint) -> float:
        """Monotonic time the endpoint last showed life on the request path: an answer, a relayed token,
        a byte on any of its calls in flight."""
        last = max(endpoint.answered_at_s, endpoint.inflight.last_token_s)
        entry = self._calls.get(endpoint.id)
        if entry is not None:
            for call in entry[1]:
                last = max(last, call.last_byte_s)
        return last

    def _stalled(self, endpoint: Endpoint, now: float, why: str) -> None:
        self.stalls += 1
        self._misses.pop(endpoint.id, None)
        if endpoint.state is EndpointState.READY:
            eject_capped(endpoint, self.fleet.pools.get(endpoint.pool), now, self.ejection, f"stalled: {why}")
        entry = self._calls.get(endpoint.id)
        calls = [c for c in entry[1] if not c.reason] if entry is not None else []
        log.warning("endpoint %s stalled (%s): cutting %d calls in flight", endpoint.id, why, len(calls))
        for call in calls:
            call.cut(STALLED)


@contextlib.asynccontextmanager
async def watching(watch: StallWatch) -> AsyncIterator[StallWatch]:
    """Run `watch.run` for the body's duration."""
    task = asyncio.create_task(watch.run(), name="stall-watch")
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---- Streams that survive their replica

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
    # a failover to a fallback model (gateway/transport/engine.py): its public name, which the
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
        for choice in answer_choices(chunk):
            content = object_field(choice, "delta").get("content") if api == "chat" else choice.get("text")
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
        completion = usage_count(usage.get("completion_tokens")) + self.sent_tokens
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
        choices = answer_choices(chunk)
        if len(choices) != 1 or self.api != "chat":
            return False
        delta = object_field(choices[0], "delta")
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
    return any(object_field(choice, "delta").get("tool_calls") for choice in answer_choices(chunk))

"""The transport seam: where a routed request goes, and how its answer reaches whoever asked.

The walk (`dispatch.py`) decides — route, gate, commit — and then hands the request to a `Transport`,
as httpx's client hands a request to its transport: `send(ctx, routed)` returns the answer in the
shape its caller takes. One walk serves every way a request arrives and every place it can go:

- `gateway/transport/engine.py`: relays to an engine over HTTP (the PD prefill leg and stream
  migration beside it) and answers the client with an aiohttp response;
- `gateway/epp/decide.py`: answers Envoy with the pick (Envoy sends the request itself) and
  follows the response Envoy streams back;
- `gateway/batch/walk.py`: answers a batch line in process, to the batch runner.

An upstream of another kind (a hosted provider's own API: Anthropic, Bedrock, Gemini) is one more
`Transport`: it writes its request from the facts and the routing decision, reads its answer back
and keeps the walk's contract below; the walk does not change.

The contract, for a transport that sends (`follows` False):
- the attempt is committed (`ctx.routed`, the dispatched hooks) before `send`; `send` calls the
  `ended` hooks exactly once, whatever happens, and settles the reservation once anything reached
  an engine (`Accounting.settle`, or `settle_unused` for an engine's own refusal);
- it raises `NotSent` when it failed before anything reached the client, so the walk may try
  another endpoint (`last` True: none is left, wait for the engine rather than give up early).
A transport whose answer outlives the walk (`follows` True: the endpoint picker, where Envoy
streams the response after the pick) ends the attempt, settles and hands the record to the sinks
itself when that answer ends; the director leaves the request open.

The walk imports no transport: the app factory builds them and hands them in (an import contract
keeps `gateway.request` from importing `gateway.transport`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, Protocol, TypeVar

from backends.fleet import Pool
from gateway.errors import GatewayError
from gateway.request.context import RequestContext, Routed

A = TypeVar("A", covariant=True)  # the answer a transport gives its caller

Fault = Literal["endpoint", "request", "crash", "adapter_lost"]


class NotSent(Exception):
    """A send failed before anything reached the client. `fault` says whose failure it was: the
    endpoint's (try another), the request's (`error` is the answer, everywhere), a crash of the
    engine on this request's content (a second one ends the walk: `gateway/upstream/engine_errors.py`),
    or `adapter_lost`: the endpoint no longer held the request's LoRA adapter, which the next send there
    loads again, so that endpoint stays a candidate for the retry (the only replica of a pool included)."""

    def __init__(self, detail: str, *, fault: Fault = "endpoint", error: GatewayError | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fault = fault
        self.error = error


class Transport(Protocol[A]):
    @property
    def follows(self) -> bool:
        """The answer outlives the walk: this transport settles and finishes the request itself."""
        ...

    def unreachable(self, pools: Sequence[Pool]) -> set[str]:
        """Ids of the endpoints this transport cannot send to (the endpoint picker's: those outside
        the subset Envoy allows); routing avoids them. A fresh set: the walk adds what it tried."""
        ...

    async def send(self, ctx: RequestContext, routed: Routed, *, last: bool) -> A:
        """Send the committed attempt; the answer for the caller, or `NotSent`."""
        ...

    def refuse(self, ctx: RequestContext, error: GatewayError, headers: Iterable[tuple[str, str]]) -> A:
        """`error` answered to the caller, in the shape of the API it called."""
        ...

"""The gate's one interface: a `Check` answers "may this request go now, on this route?".

The waiting room's front door (`gateway/flow/gate.py`) asks every check, in the order the app
factory lists them, each time the request might go: on arrival, then on every wake of its pool's
room (`docs/architecture.md`, "The gate: one room, many checks"). Each answers one verdict:

- `GO`: nothing against it here; the next check is asked (the last one's GO dispatches);
- `Wait(scope, reason, answer)`: not now; the request waits in its pool's room, in flow order.
  `scope` says who else that holds back (`Blocked.POOL`: nobody waiting there goes;
  `Blocked.TENANT`: nobody of this tenant; `Blocked.PROGRAM`: nobody of this request's program;
  `Blocked.REQUEST`: only this one). `answer`, when set, is
  what the request is told if it waits this out until its deadline (else its band's answer);
- `Avoid(endpoints, otherwise)`: not on these endpoints: the room routes again without them (and
  without any an earlier check avoided) and asks every check again on the new route; when no route
  is left, `otherwise` is the verdict;
- `Refuse(detour)`: not here at all: the request leaves the room with that `Detour` (the director
  answers it or walks the model's fallback chain).

A check never waits, sleeps or routes itself: waiting and routing again are the room's job, in one
place. Besides `check`, a check may shape the turn before the first ask (`enter`: bound or stretch
its deadline, hold a request that has no route yet, refuse at once) and hear that the request goes
(`went`). Per-request state a check needs while the request waits lives on the `Turn` (this wait)
or on the request context (`gateway/request/context.py`), never in a table keyed by request.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final, Protocol

from gateway.flow.types import Blocked, FlowRequest
from gateway.request import Detour, RequestContext, Routed


@dataclass(frozen=True, slots=True)
class Go:
    """Nothing against the request going on this route."""


GO: Final = Go()


@dataclass(frozen=True, slots=True)
class Wait:
    """Not now: wait in the room. `answer(waited_s)`: the reply to a request that waits this out."""

    scope: Blocked
    reason: str
    answer: Callable[[float], Detour] | None = None


@dataclass(frozen=True, slots=True)
class Refuse:
    """Not on this model: leave the room with `detour`."""

    detour: Detour


@dataclass(frozen=True, slots=True)
class Avoid:
    """Not on these endpoints: route again without them; `otherwise` when no route is left."""

    endpoints: Collection[str]
    otherwise: Go | Wait | Refuse


Verdict = Go | Wait | Avoid | Refuse


@dataclass(slots=True)
class Turn:
    """One request's turn at the gate (one `Gate.admit`): what the checks read and may note.

    `pool`: the room it waits in (its route's pool; set by a check's `enter` when it has no route);
    `deadline_s`: monotonic, the band's bound until every `enter` had its say; `unrouted`: the wait
    that holds a request with no route (a cold start), None when such a request is not held;
    `routed_s`: when it first had a route; `last_wait`: the latest `Wait` it got (its answer applies
    at the deadline); `preempt_asked_s`: when a stream was last cut for it (flow control)."""

    ctx: RequestContext
    request: FlowRequest
    pool: str
    began_s: float
    deadline_s: float
    unrouted: Wait | None = None
    routed_s: float | None = None
    last_wait: Wait | None = None
    preempt_asked_s: float = field(default=float("-inf"))


class Check(Protocol):
    """One reason a request may not go now (see the module docstring). Subclass it and override
    `check`, and `enter` / `went` where the check needs them."""

    def enter(self, turn: Turn, routed: Routed | None) -> None:
        """Once per turn, before the first ask; may change `turn.deadline_s`, set `turn.pool` and
        `turn.unrouted` (hold a request that has no route), or raise a `Detour` (refuse at once)."""
        return None

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        """The verdict on `routed` now."""
        ...

    def went(self, turn: Turn, routed: Routed) -> None:
        """The request goes on `routed` (after every check said GO)."""
        return None

"""Hooks: features that follow a request through the walk, one method per phase; and the gate.

The walk (`gateway/request/`) names the phases and owns none of the features; a feature (the SLO
objectives, the predictor's learning, the engine tokenizer, ...) subclasses `Hook`, overrides
the phases it needs, and is put in the hook list the app factory builds (`gateway/app/factory.py`). The walk
imports no hook module (an import contract checks it).

Phases, in the order one request meets them:

    prepare(ctx)                 async, once per model of the fallback chain, before routing on it:
                                 fill the routing inputs (`ctx.routing`); it never waits
    dispatched(ctx)              sync, the walk committed to `ctx.routed` (once per attempt)
    first_token(ctx, at_s)       sync, a stream's first token was relayed (perf_counter time)
    ended(ctx)                   sync, that attempt's upstream call ended: success, failure, abort
                                 (exactly once after each `dispatched`)
    finished(ctx)                sync, once per request, after its record is filled, before sinks

Hooks observe; none decides whether the request may go. That is the `Gate`'s: the walk asks it once
per attempt, after routing and before anything is sent (`Gate.admit`: the route to go on, after
waiting if need be; cancellable; or a `Detour`). The app's gate is the waiting room and its checks
(`gateway/flow/gate.py`); `OPEN_GATE` lets everything through at once. A hook's own failure in a
sync phase is logged and does not break the request or the other hooks; `prepare` and the gate are
part of the decision, so their exceptions (a `Detour` above all) propagate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Final, Protocol

from gateway.request.context import RequestContext, Routed

log = logging.getLogger("tokenway.request.hooks")

Reroute = Callable[[Collection[str]], Routed | None]  # route again on the model, excluding these endpoints


class Gate(Protocol):
    """May the request go now, and where: the one place the walk asks (see the module docstring)."""

    async def admit(self, ctx: RequestContext, routed: Routed | None, reroute: Reroute) -> Routed | None:
        """The route to dispatch on (`routed`, or one from `reroute(exclude)`), after waiting if need
        be; None when `routed` is None and nothing is worth waiting for; or raise `Detour`."""
        ...


class OpenGate:
    """A gate that holds nothing: every route goes at once (the walk without flow control)."""

    async def admit(self, ctx: RequestContext, routed: Routed | None, reroute: Reroute) -> Routed | None:
        return routed


OPEN_GATE: Final = OpenGate()


class Hook:
    """A feature of the walk. Every phase is a no-op here: override the ones the feature needs."""

    async def prepare(self, ctx: RequestContext) -> None:
        return None

    def dispatched(self, ctx: RequestContext) -> None:
        return None

    def first_token(self, ctx: RequestContext, at_s: float) -> None:
        return None

    def ended(self, ctx: RequestContext) -> None:
        return None

    def finished(self, ctx: RequestContext) -> None:
        return None


def _overrides(hook: Hook, phase: str) -> bool:
    return getattr(type(hook), phase) is not getattr(Hook, phase)


class Hooks:
    """The app's hooks, sorted by phase once at start-up: a phase nobody overrides costs nothing."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.all = tuple(hooks)
        self._prepare = [h for h in self.all if _overrides(h, "prepare")]
        self._dispatched = [h for h in self.all if _overrides(h, "dispatched")]
        self._first_token = [h for h in self.all if _overrides(h, "first_token")]
        self._ended = [h for h in self.all if _overrides(h, "ended")]
        self._finished = [h for h in self.all if _overrides(h, "finished")]

    @property
    def want_first_token(self) -> bool:
        return bool(self._first_token)

    async def prepare(self, ctx: RequestContext) -> None:
        for hook in self._prepare:
            await hook.prepare(ctx)

    def dispatched(self, ctx: RequestContext) -> None:
        for hook in self._dispatched:
            try:
                hook.dispatched(ctx)
            except Exception:  # one feature's bug must not cost the request or the other hooks
                log.exception("hook %s failed in dispatched", type(hook).__name__)

    def first_token(self, ctx: RequestContext, at_s: float) -> None:
        for hook in self._first_token:
            try:
                hook.first_token(ctx, at_s)
            except Exception:
                log.exception("hook %s failed in first_token", type(hook).__name__)

    def ended(self, ctx: RequestContext) -> None:
        for hook in self._ended:
            try:
                hook.ended(ctx)
            except Exception:
                log.exception("hook %s failed in ended", type(hook).__name__)

    def finished(self, ctx: RequestContext) -> None:
        for hook in self._finished:
            try:
                hook.finished(ctx)
            except Exception:
                log.exception("hook %s failed in finished", type(hook).__name__)

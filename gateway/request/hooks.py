"""Hooks: features that follow a request through the walk, one method per phase.

The walk (`gateway/request/`) names the phases and owns none of the features; a feature (the SLO
gate and its queue, the predictor's learning, the engine tokenizer, ...) subclasses `Hook`, overrides
the phases it needs, and is put in the hook list the app factory builds (`gateway/app/factory.py`). The walk
imports no hook module (an import contract checks it).

Phases, in the order one request meets them:

    prepare(ctx)                 async, once per model of the fallback chain, before routing on it:
                                 fill the routing inputs (`ctx.routing`)
    gate(ctx, routed, reroute)   async, after each routing decision, before anything is sent: return
                                 the `Routed` to dispatch (the same, or one from `reroute(exclude)`),
                                 wait first if need be (cancellable: a cancelled wait needs no
                                 clean-up beyond the hook's own), or raise `Detour`
    dispatched(ctx)              sync, the walk committed to `ctx.routed` (once per attempt)
    first_token(ctx, at_s)       sync, a stream's first token was relayed (perf_counter time)
    ended(ctx)                   sync, that attempt's upstream call ended: success, failure, abort
                                 (exactly once after each `dispatched`)
    finished(ctx)                sync, once per request, after its record is filled, before sinks

Gate hooks run in list order, each on the previous one's answer. A hook's own failure in a sync
phase is logged and does not break the request or the other hooks; `prepare` and `gate` are part
of the decision, so their exceptions (a `Detour` above all) propagate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

from gateway.request.context import RequestContext, Routed

log = logging.getLogger("tokenway.request.hooks")

Reroute = Callable[[Collection[str]], Routed | None]  # route again on the model, excluding these endpoints


class Hook:
    """A feature of the walk. Every phase is a no-op here: override the ones the feature needs."""

    async def prepare(self, ctx: RequestContext) -> None:
        return None

    async def gate(self, ctx: RequestContext, routed: Routed, reroute: Reroute) -> Routed:
        return routed

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
        self._gate = [h for h in self.all if _overrides(h, "gate")]
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

    async def gate(self, ctx: RequestContext, routed: Routed, reroute: Reroute) -> Routed:
        for hook in self._gate:
            routed = await hook.gate(ctx, routed, reroute)
        return routed

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

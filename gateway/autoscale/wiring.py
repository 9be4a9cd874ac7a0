"""The autoscaler's place in the app: built after the fleet, before the walk; stopped before the
fleet's replicas are (`gateway/app/factory.py` appends `autoscale_ctx` and adds the hook it returns)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from backends.autoscale.executor import Executor
from gateway.app import keys as appkeys
from gateway.autoscale.hold import ColdStart, ElasticHook
from gateway.autoscale.loop import Autoscaler
from gateway.telemetry.metrics import PoolMetrics
from policies.autoscale.forecast import LeadTimes

AUTOSCALER = web.AppKey("autoscaler", Autoscaler)
ELASTIC_HOOK = web.AppKey("elastic_hook", ElasticHook)


async def autoscale_ctx(app: web.Application) -> AsyncIterator[None]:
    fleet = app[appkeys.FLEET]
    executor = Executor(
        app[appkeys.SUPERVISOR], fleet, app[appkeys.BACKENDS], lead=LeadTimes(), session=app[appkeys.SESSION]
    )
    prior = app[appkeys.SETTINGS].predictor.prior
    autoscaler = Autoscaler(fleet, executor, prior)
    app[AUTOSCALER] = autoscaler
    metrics = PoolMetrics(app[appkeys.METRICS])  # stream migrations are counted in every pool
    metrics.set_status(autoscaler.status)
    lead = executor.lead
    cold = ColdStart(
        fleet,
        executor.expected_ready_in_s,
        lead.startup_s,
        on_hold=lambda pool: autoscaler.poke(),
        on_wait=metrics.observe_cold_start,
    )
    autoscaler.held = cold.held

    def changed(pool: str, action: str) -> None:
        if action in ("ready", "awake"):
            cold.notify(pool)
        else:  # devices were given back: another pool may take them now
            autoscaler.poke()

    executor.on_change = changed
    app[ELASTIC_HOOK] = ElasticHook(fleet, autoscaler, cold, metrics)
    if not autoscaler.enabled:
        yield
        return
    executor.start()
    task = asyncio.get_running_loop().create_task(autoscaler.run(), name="autoscaler")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await executor.close()

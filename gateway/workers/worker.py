"""One worker of a group: `python -m gateway.workers.worker [--restarted]`, started by the group's
parent, which writes its spec to the worker's stdin (a pipe: the settings hold resolved secrets, and
no file of them is left behind even by a parent killed outright).

The spec carries the worker's index, the group's size and private directory, the parent's pid and the
worker's whole settings tree (gateway/workers/plan.py), so a
worker never re-reads gateway.yaml: every worker of a group, restarted ones included, serves exactly
what the parent validated. It binds the group's port with SO_REUSEPORT, serves its metrics to its
siblings, and dies with the parent (`die_with_parent`: even a `kill -9`ed one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from backends.process import die_with_parent
from gateway.app import keys as appkeys
from gateway.app.factory import create_app
from gateway.app.server import AppFactory, run
from gateway.app.settings import GatewaySettings
from gateway.http.routes import METRICS_GROUP, METRICS_RENDER, ready_by_rule
from gateway.workers.metrics import GroupMetrics

RESTARTED = "--restarted"  # argv flag: the group restarts this worker while its siblings serve


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    workers: int
    directory: Path
    parent_pid: int
    log_level: str
    source: str
    settings: dict[str, Any]

    def dump(self) -> str:
        return json.dumps({**self.__dict__, "directory": str(self.directory)})

    @classmethod
    def load(cls, text: str) -> WorkerSpec:
        doc = json.loads(text)
        return cls(**{**doc, "directory": Path(doc["directory"])})

    def gateway_settings(self) -> GatewaySettings:
        return GatewaySettings.model_validate(self.settings).model_copy(update={"source": self.source})


JOIN_WAIT_S = 60.0  # a restarted worker waits at most this for its pools before it takes connections


def app_factory(spec: WorkerSpec, *, restarted: bool = False) -> AppFactory:
    """The ordinary app, plus its part in the group's /metrics. A restarted worker joins the port only
    once its pools are ready (as /readyz judges, or after `JOIN_WAIT_S`): its siblings serve meanwhile,
    and connections the kernel would hand it before its first health probes would get 503s."""

    def build(settings: GatewaySettings) -> web.Application:
        app = create_app(settings)
        if restarted:
            app.on_startup.append(_ready_to_join)
        group = GroupMetrics(spec.directory, spec.index, spec.workers, lambda: app[METRICS_RENDER]())
        if settings.telemetry.metrics.enabled:
            app[METRICS_GROUP] = group.render_group

        async def start(_: web.Application) -> None:
            await group.start()

        async def stop(_: web.Application) -> None:
            await group.stop()

        app.on_startup.append(start)
        app.on_cleanup.append(stop)
        return app

    return build


async def _ready_to_join(app: web.Application) -> None:
    server = app[appkeys.SETTINGS].server
    deadline = time.monotonic() + JOIN_WAIT_S
    while time.monotonic() < deadline:
        pools = {name: pool.can_serve for name, pool in app[appkeys.FLEET].pools.items()}
        if ready_by_rule(pools, server.ready_when, server.default_pool):
            return
        await asyncio.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    restarted = args == [RESTARTED]
    if args and not restarted:
        print(f"usage: python -m gateway.workers.worker [{RESTARTED}] < SPEC (started by `tokenway serve --workers N`)",
              file=sys.stderr)  # fmt: skip
        return 2
    spec = WorkerSpec.load(sys.stdin.read())
    die_with_parent(spec.parent_pid)
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s w{spec.index} %(name)s: %(message)s",
    )
    factory = app_factory(spec, restarted=restarted)
    return run(spec.gateway_settings(), factory, reuse_port=True, banner=spec.index == 0 and not restarted)


if __name__ == "__main__":
    sys.exit(main())

"""Start simulated engines in the running event loop: one engine + one HTTP site per instance.

In-process use (tests, benchmarks)::

    async with run_sim_instances("llama-3.1-8b@h100", count=2, time_scale=10) as urls:
        ...  # urls == ["http://127.0.0.1:PORT0", "http://127.0.0.1:PORT1"]

Keyword arguments other than the ones named below go to `build_engine_config` (max_num_seqs,
num_gpu_blocks_override, kv_events_config, ...). Ports are free ones unless `port` is given, in which
case instance i listens on port + i. Sockets are bound first and only listen once the engine runs,
so a client sees "connection refused" until the instance is ready, as with vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from sim.config import EngineConfig, build_engine_config
from sim.engine import SimEngine
from sim.http_api import build_app

log = logging.getLogger("tokenway.sim")


@dataclass(slots=True)
class SimInstance:
    engine: SimEngine
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


async def start_instance(config: EngineConfig, host: str = "127.0.0.1", port: int = 0, index: int = 0) -> SimInstance:
    """Bind, come up (`config.startup_s` simulated seconds: weights and initialisation), start the
    engine, then listen. The caller owns `stop_instance`."""
    sock = _bind(host, port)
    try:
        if config.startup_s > 0:
            log.info("loading %s: ready in %.1f s simulated", config.preset.name, config.startup_s)
            await asyncio.sleep(config.startup_s / config.time_scale)
        bound_port = sock.getsockname()[1]
        engine = SimEngine(config, instance_index=index)
        engine.advertised_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        engine.advertised_port = bound_port
        await engine.start()
        try:
            runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.SockSite(runner, sock)
            await site.start()
        except BaseException:
            await engine.stop()
            raise
    except BaseException:
        sock.close()
        raise
    return SimInstance(engine, runner, host, bound_port)


async def stop_instance(instance: SimInstance) -> None:
    await instance.runner.cleanup()
    await instance.engine.stop()


async def start_instances(
    config: EngineConfig, count: int, host: str = "127.0.0.1", port: int = 0
) -> list[SimInstance]:
    """Start `count` engines side by side (their start-ups overlap, as separate processes' would)."""
    configs = [
        replace(config) if i == 0 else replace(config, engine_id=f"{config.engine_id}-{i}") for i in range(count)
    ]
    tasks = [asyncio.ensure_future(start_instance(c, host, port + i if port else 0, i)) for i, c in enumerate(configs)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                await stop_instance(task.result())
        raise


@contextlib.asynccontextmanager
async def run_sim_instances(
    preset: str = "llama-3.1-8b@h100",
    count: int = 1,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    time_scale: float = 1.0,
    **engine_overrides: Any,
) -> AsyncIterator[list[str]]:
    """Run `count` engines in this loop for the duration of the block; yields their base URLs."""
    config = build_engine_config(preset, time_scale=time_scale, **engine_overrides)
    instances = await start_instances(config, count, host, port)
    try:
        yield [instance.url for instance in instances]
    finally:
        for instance in instances:
            await stop_instance(instance)


@contextlib.asynccontextmanager
async def run_sim_engines(
    preset: str = "llama-3.1-8b@h100", count: int = 1, **kwargs: Any
) -> AsyncIterator[list[SimInstance]]:
    """Like run_sim_instances, but yields the instances (engine objects included) for white-box use."""
    host = kwargs.pop("host", "127.0.0.1")
    port = kwargs.pop("port", 0)
    config = build_engine_config(preset, **kwargs)
    instances = await start_instances(config, count, host, port)
    try:
        yield instances
    finally:
        for instance in instances:
            await stop_instance(instance)


async def serve_forever(config: EngineConfig, count: int, host: str, port: int, startup_delay_s: float = 0.0) -> None:
    """The CLI's main: optional startup delay, start, print readiness, run until cancelled."""
    if startup_delay_s > 0:
        await asyncio.sleep(startup_delay_s)
    instances = await start_instances(config, count, host, port)
    for instance in instances:
        print(f"tokenway-sim ready on http://{instance.host}:{instance.port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for instance in instances:
            await stop_instance(instance)

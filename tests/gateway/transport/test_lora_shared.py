"""LoRA adapter activity shared by two gateway processes through a real Redis (`lora_shared.py`), against
a simulated engine on a real socket: one process's uses keep the other's keeper from unloading an
adapter as idle, its requests count in the other's demand, and each one's on-demand loads count in the
other's autoscaler rate. Each "process" is its own fleet, loader, keeper and share; the keepers are
ticked by hand with a clock the test moves, and the shares flushed by hand (`sync`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from backends.config import PoolConfig
from backends.fleet import Fleet, LoraAdapter, Pool
from backends.types import Endpoint, EndpointState
from gateway.console.adapters import adapter_view
from gateway.transport.lora import AdapterKeeper, AdapterLoader
from gateway.transport.lora_shared import SharedAdapters
from gateway.upstream.client import UpstreamClient
from policies.routing.lora import AdapterResidency
from sim.server import SimInstance, run_sim_engines

pytestmark = pytest.mark.redis

MODEL = "llama-3.1-8b"
CHAT = LoraAdapter("chat-lora", MODEL, "s3://adapters/chat")
SQL = LoraAdapter("sql-lora", MODEL, "s3://adapters/sql")


class Clock:
    now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class Gateway:
    fleet: Fleet
    loader: AdapterLoader
    keeper: AdapterKeeper
    share: SharedAdapters
    residency: AdapterResidency

    @property
    def endpoint(self) -> Endpoint:
        return self.fleet.pools["base"].endpoints[0]

    async def serve(self, adapter: LoraAdapter) -> None:
        """One request for `adapter`: loaded if need be, begun and ended."""
        await self.loader.ensure(self.endpoint, adapter)
        self.loader.begin(self.endpoint, adapter.name)
        self.loader.end(self.endpoint, adapter.name)


@pytest.fixture
async def engine() -> AsyncIterator[SimInstance]:
    async with run_sim_engines("llama-3.1-8b@h100", 1, served_model_names=[MODEL], enable_lora=True) as found:
        yield found[0]


def _gateway(instance: SimInstance, upstream: UpstreamClient, clock: Clock, redis_url: str, prefix: str) -> Gateway:
    config = PoolConfig.model_validate({
        "name": "base", "model": MODEL, "engine": "vllm", "lora_idle_unload_s": 60.0,
        "endpoints": [{"url": instance.url}],
    })  # fmt: skip
    pool = Pool(config)
    pool.endpoints.append(Endpoint("base/both-s0", "base", instance.url, "vllm", MODEL, state=EndpointState.READY))
    fleet = Fleet([pool])
    fleet.follow_adapters(lambda: {CHAT.name: CHAT, SQL.name: SQL})
    loader = AdapterLoader(upstream, clock=clock)
    residency = AdapterResidency()
    share = SharedAdapters.from_url(redis_url, loader, fleet, prefix=prefix, residency=residency)
    share.clock = share.redis_clock = clock  # the scripts read the test's clock too
    loader.share = share
    return Gateway(fleet, loader, AdapterKeeper(fleet, loader, clock=clock), share, residency)


async def _holds(gateway: Gateway, adapter: str) -> bool:
    return gateway.loader.registered(gateway.endpoint, adapter)


async def test_one_process_uses_keep_the_other_from_unloading(
    engine: SimInstance, redis_url: str, redis_prefix: str
) -> None:
    clock = Clock()
    async with UpstreamClient(read_timeout_s=10) as upstream:
        a = _gateway(engine, upstream, clock, redis_url, redis_prefix)
        b = _gateway(engine, upstream, clock, redis_url, redis_prefix)
        try:
            await b.serve(CHAT)  # B loads it and uses it once
            await a.serve(CHAT)
            await a.share.sync()
            await b.share.sync()
            for _ in range(4):  # A keeps using it every 40 s; B's own last use grows old
                clock.now_s += 40.0
                await a.serve(CHAT)
                await a.share.sync()
                await b.share.sync()
                b.keeper.tick()
                await b.keeper.settled()
                assert await _holds(b, "chat-lora"), "B unloaded an adapter A is still using"
                held = next(h for h in b.loader.held() if h.adapter == "chat-lora")
                assert clock.now_s - held.last_used_s >= 40.0
                assert clock.now_s - b.loader.last_used(held) < 1.0  # the fleet's last use: A's, just now
            lora = engine.engine.lora
            assert lora is not None and lora.knows("chat-lora")  # still on the engine

            # a request in flight at A keeps it in use without any new request
            a.loader.begin(a.endpoint, "chat-lora")
            clock.now_s += 100.0
            await a.share.sync()  # stamps what is in flight as used now
            await b.share.sync()
            b.keeper.tick()
            await b.keeper.settled()
            assert await _holds(b, "chat-lora")
            a.loader.end(a.endpoint, "chat-lora")
            await a.share.sync()

            # nobody uses it: B unloads it once the fleet's idle time passes
            clock.now_s += 61.0
            await b.share.sync()
            b.keeper.tick()
            await b.keeper.settled()
            assert not await _holds(b, "chat-lora")
            assert not lora.knows("chat-lora")
        finally:
            await a.share.close()
            await b.share.close()


async def test_demand_and_loads_count_every_process(engine: SimInstance, redis_url: str, redis_prefix: str) -> None:
    clock = Clock()
    async with UpstreamClient(read_timeout_s=10) as upstream:
        a = _gateway(engine, upstream, clock, redis_url, redis_prefix)
        b = _gateway(engine, upstream, clock, redis_url, redis_prefix)
        try:
            await a.share.sync()  # both have read the pool once: what comes next is new
            await b.share.sync()
            await a.serve(SQL)  # A: one on-demand load, then five requests
            for _ in range(4):
                await a.serve(SQL)
            await b.serve(CHAT)  # B: one load of another adapter
            await a.share.sync()
            await b.share.sync()
            await a.share.sync()
            assert a.share.pool_loads("base") == b.share.pool_loads("base") == 2  # the autoscaler's count
            assert a.loader.pool_loads("base") == b.loader.pool_loads("base") == 1  # each process's own
            # A's five requests are in B's demand: the hottest for preloads, the router's victim weighing
            assert b.loader.hottest(["chat-lora", "sql-lora"], 1) == ["sql-lora"]
            assert b.residency.demand("sql-lora", clock.now_s) == pytest.approx(5.0)
            assert a.residency.demand("chat-lora", clock.now_s) == pytest.approx(1.0)
            # the console's counters of the shared replica: both processes' loads, from either
            for gateway in (a, b):
                found = gateway.share.fleet_activity(gateway.endpoint)
                assert found is not None and (found.loads, found.failures) == (2, 0)
                pools: Any = adapter_view(gateway.fleet, gateway.loader, clock.now_s)["pools"]
                (replica,) = pools[0]["replicas"]
                assert (replica["loads"], replica["counted_by"]) == (2, "fleet")
            await a.share.sync()  # read again: nothing new, nothing counted twice
            assert a.share.pool_loads("base") == 2
            found = a.share.fleet_activity(a.endpoint)
            assert found is not None and found.loads == 2
            assert a.residency.demand("chat-lora", clock.now_s) == pytest.approx(1.0)

            client = aioredis.Redis.from_url(redis_url)
            key = a.share.key("base")
            assert await client.pttl(key) > 0  # expires
            assert await client.hget(key, "l") == b"2"
            await client.aclose()
        finally:
            await a.share.close()
            await b.share.close()


async def test_fields_are_capped_and_an_unreachable_redis_is_no_error(
    engine: SimInstance, redis_url: str, redis_prefix: str
) -> None:
    clock = Clock()
    async with UpstreamClient(read_timeout_s=10) as upstream:
        a = _gateway(engine, upstream, clock, redis_url, redis_prefix)
        a.share.max_fields = 2
        try:
            await a.serve(CHAT)
            await a.serve(SQL)  # four fields wanted (two uses, two demands, loads): two kept
            await a.share.sync()
            client = aioredis.Redis.from_url(redis_url)
            assert await client.hlen(a.share.key("base")) == 2
            await client.aclose()
        finally:
            await a.share.close()
        away = _gateway(engine, upstream, clock, "redis://127.0.0.1:1/0", redis_prefix)
        try:
            await away.serve(CHAT)
            await away.share.sync()  # refused: counted, the uses kept for the next call
            assert away.share.errors == 1
            held = next(away.loader.held())
            assert away.loader.last_used(held) == held.last_used_s
        finally:
            await away.share.close()

"""LoRA adapters over their life on a replica, against simulated engines serving on real sockets:
discovery from `/v1/models`, the loader trusting (and doubting) what an engine lists, preloads, idle
unloads, and the events the metrics count. The keeper is ticked by hand with a clock the test moves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest

from backends.config import BackendsSettings, PoolConfig
from backends.fleet import Fleet, LoraAdapter, Pool
from backends.scrape import LoraDiscovery, listed_adapters
from backends.types import Endpoint, EndpointState
from gateway.transport.lora import AdapterKeeper, AdapterLoader
from gateway.upstream.client import UpstreamClient
from sim.lora import LoraSlots
from sim.server import SimInstance, run_sim_engines

MODEL = "llama-3.1-8b"
SQL = LoraAdapter("sql-lora", MODEL, "s3://adapters/sql")
CHAT = LoraAdapter("chat-lora", MODEL, "s3://adapters/chat", idle_unload_s=30.0)
PINNED = LoraAdapter("pinned-lora", MODEL, "s3://adapters/pinned", preload=True)
BROKEN = LoraAdapter("broken-lora", MODEL, "/no/such/adapter", preload=True)


class Clock:
    now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
async def engines() -> AsyncIterator[list[SimInstance]]:
    options: dict[str, Any] = {"served_model_names": [MODEL], "enable_lora": True, "max_loras": 4}
    async with run_sim_engines("llama-3.1-8b@h100", 2, **options) as instances:
        _slots(instances[1]).register("sql-lora", "s3://adapters/sql")  # as `--lora-modules` would
        yield instances


def _slots(instance: SimInstance) -> LoraSlots:
    assert instance.engine.lora is not None
    return instance.engine.lora


def _fleet(
    instances: list[SimInstance], adapters: Mapping[str, LoraAdapter], idle_s: float | None, hottest: int = 0
) -> Fleet:
    config = PoolConfig.model_validate({
        "name": "base", "model": MODEL, "engine": "vllm", "lora_idle_unload_s": idle_s,
        "lora_preload_hottest": hottest, "endpoints": [{"url": i.url} for i in instances],
    })  # fmt: skip
    pool = Pool(config)
    for n, instance in enumerate(instances):
        endpoint = Endpoint(f"base/both-s{n}", "base", instance.url, "vllm", MODEL, state=EndpointState.READY)
        pool.endpoints.append(endpoint)
    fleet = Fleet([pool])
    fleet.follow_adapters(lambda: adapters)
    return fleet


async def _listed(http: aiohttp.ClientSession, url: str) -> frozenset[str]:
    async with http.get(url + "/v1/models") as response:
        names = listed_adapters(await response.read())
    assert names is not None
    return names


def test_models_list_parsing_keeps_adapters_only() -> None:
    body = (
        b'{"object":"list","data":[{"id":"base","parent":null},{"id":"a","parent":"base"},'
        b'{"id":"b","parent":"base"},{"id":"odd","parent":""},"junk",{"parent":"base"}]}'
    )
    assert listed_adapters(body) == frozenset({"a", "b"})
    assert listed_adapters(b"not json") is None
    assert listed_adapters(b'{"error": "nope"}') is None


async def test_discovery_sees_what_each_engine_holds(engines: list[SimInstance]) -> None:
    fleet = _fleet(engines, {"sql-lora": SQL}, None)
    discovery = LoraDiscovery(BackendsSettings(), Clock())
    first, second = fleet.pools["base"].endpoints
    async with aiohttp.ClientSession() as http:
        assert list(discovery.candidates(_fleet(engines, {}, None))) == []  # no adapter: nobody is asked
        assert [e.id for e in discovery.candidates(fleet)] == [first.id, second.id]
        assert await discovery.discover(first, http) and await discovery.discover(second, http)
    assert first.loras == frozenset() and second.loras == frozenset({"sql-lora"})
    assert second.loras_at_s == 1000.0


async def test_loader_trusts_listings_and_keeper_preloads_and_unloads_idle(engines: list[SimInstance]) -> None:
    clock = Clock()
    events: list[tuple[str, str]] = []
    adapters = {a.name: a for a in (SQL, CHAT, PINNED, BROKEN)}
    fleet = _fleet(engines, adapters, idle_s=60.0)
    first, second = fleet.pools["base"].endpoints
    discovery = LoraDiscovery(BackendsSettings(), clock)
    async with UpstreamClient(read_timeout_s=10) as upstream, aiohttp.ClientSession() as http:
        loader = AdapterLoader(upstream, on_event=lambda name, event: events.append((name, event)), clock=clock)
        keeper = AdapterKeeper(fleet, loader, clock=clock)
        for endpoint in (first, second):
            await discovery.discover(endpoint, http)

        # an adapter the engine lists is served without a load; elsewhere it is loaded
        await loader.ensure(second, SQL)
        await loader.ensure(first, SQL)
        assert events == [("sql-lora", "load")]
        assert loader.registered(second, "sql-lora") and loader.registered(first, "sql-lora")

        # preload: on every ready replica, once; a source the engine refuses is not retried every pass
        keeper.tick()
        await keeper.settled()
        for instance in engines:
            assert "pinned-lora" in await _listed(http, instance.url)
        assert events.count(("pinned-lora", "preload")) == 2
        assert events.count(("broken-lora", "load_failed")) == 2
        keeper.tick()
        await keeper.settled()
        assert events.count(("pinned-lora", "preload")) == 2 and events.count(("broken-lora", "load_failed")) == 2
        clock.now_s += keeper.retry_s
        keeper.tick()
        await keeper.settled()
        assert events.count(("broken-lora", "load_failed")) == 4

        # idle unload: chat-lora's own 30 s, sql-lora the pool's 60 s; in use or preloaded, never
        await loader.ensure(first, CHAT)
        loader.begin(first, "sql-lora")  # a request for it is running on `first`
        clock.now_s += 31.0
        keeper.tick()
        await keeper.settled()
        held = await _listed(http, engines[0].url)
        assert "chat-lora" not in held and "sql-lora" in held and "pinned-lora" in held
        assert ("chat-lora", "unload") in events and not loader.registered(first, "chat-lora")
        clock.now_s += 60.0
        keeper.tick()
        await keeper.settled()
        assert "sql-lora" in await _listed(http, engines[0].url)  # still in use
        assert "sql-lora" not in await _listed(http, engines[1].url)  # idle there: unloaded
        loader.end(first, "sql-lora")
        clock.now_s += 60.0
        keeper.tick()
        await keeper.settled()
        assert await _listed(http, engines[0].url) == frozenset({"pinned-lora"})
        assert events.count(("sql-lora", "unload")) == 2

        # an engine that lost what the gateway registered (a restart) says so in its next listing
        await loader.ensure(first, CHAT)
        _slots(engines[0]).unregister("chat-lora")
        clock.now_s += 1.0
        await discovery.discover(first, http)
        await loader.ensure(first, CHAT)
        assert ("chat-lora", "lost") in events and "chat-lora" in await _listed(http, engines[0].url)


async def test_the_hottest_adapters_follow_demand_onto_every_replica(engines: list[SimInstance]) -> None:
    clock = Clock()
    fleet = _fleet(engines, {"sql-lora": SQL, "chat-lora": CHAT}, idle_s=60.0, hottest=1)
    first, second = fleet.pools["base"].endpoints
    async with UpstreamClient(read_timeout_s=10) as upstream, aiohttp.ClientSession() as http:
        loader = AdapterLoader(upstream, clock=clock)
        keeper = AdapterKeeper(fleet, loader, clock=clock)
        keeper.tick()
        await keeper.settled()
        assert "chat-lora" not in await _listed(http, engines[0].url)  # no demand yet: nothing preloaded
        for _ in range(3):
            loader.begin(first, "chat-lora")
            loader.end(first, "chat-lora")
        loader.begin(first, "sql-lora")
        loader.end(first, "sql-lora")
        assert loader.hottest(["sql-lora", "chat-lora"], 2) == ["chat-lora", "sql-lora"]
        keeper.tick()
        await keeper.settled()
        for instance in engines:
            assert "chat-lora" in await _listed(http, instance.url)
        clock.now_s += 120.0  # past chat-lora's idle time: the hottest stays
        keeper.tick()
        await keeper.settled()
        assert loader.registered(second, "chat-lora")
        for _ in range(5):  # demand moves to sql-lora: it is preloaded, chat-lora goes idle and leaves
            loader.begin(second, "sql-lora")
            loader.end(second, "sql-lora")
        keeper.tick()
        await keeper.settled()
        keeper.tick()
        await keeper.settled()
        for instance in engines:
            assert await _listed(http, instance.url) == frozenset({"sql-lora"})

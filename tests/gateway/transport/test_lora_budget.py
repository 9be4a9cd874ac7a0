"""A pool's LoRA memory budget at the loader, against simulated engines on real sockets: a load that
would take a replica's registered adapters over the budget unloads the least recently used idle ones
first (never one in use, never a preloaded one, a pool's hottest last), a load that cannot fit fails
as that endpoint's fault, and every load and eviction is counted per replica (the console's view, the
autoscaler's demand)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from backends.config import PoolConfig
from backends.fleet import MB, Fleet, LoraAdapter, Pool
from backends.scrape import listed_adapters
from backends.types import Endpoint, EndpointState
from gateway.console.adapters import adapter_view
from gateway.transport.lora import AdapterLoader, LoadFailed, fleet_budget
from gateway.upstream.client import UpstreamClient
from sim.server import SimInstance, run_sim_engines

MODEL = "llama-3.1-8b"
A, B, C, D = (LoraAdapter(f"{n}-lora", MODEL, f"s3://adapters/{n}", 64 * MB) for n in "abcd")
PINNED = LoraAdapter("pinned-lora", MODEL, "s3://adapters/pinned", 64 * MB, preload=True)
ADAPTERS = {a.name: a for a in (A, B, C, D, PINNED)}


class Clock:
    now_s = 1000.0

    def __call__(self) -> float:
        self.now_s += 1.0  # every read is a moment later: last uses are ordered
        return self.now_s


@pytest.fixture
async def engine() -> AsyncIterator[SimInstance]:
    options = {"served_model_names": [MODEL], "enable_lora": True, "max_loras": 8}
    async with run_sim_engines("llama-3.1-8b@h100", 1, **options) as instances:
        yield instances[0]


def _fleet(instance: SimInstance, budget_mb: float) -> tuple[Fleet, Endpoint]:
    config = PoolConfig.model_validate({
        "name": "base", "model": MODEL, "engine": "vllm", "lora_memory_budget_mb": budget_mb,
        "endpoints": [{"url": instance.url}],
    })  # fmt: skip
    pool = Pool(config)
    endpoint = Endpoint("base/both-s0", "base", instance.url, "vllm", MODEL, state=EndpointState.READY)
    pool.endpoints.append(endpoint)
    fleet = Fleet([pool])
    fleet.follow_adapters(lambda: ADAPTERS)
    return fleet, endpoint


async def _listed(url: str) -> frozenset[str]:
    async with aiohttp.ClientSession() as http, http.get(url + "/v1/models") as response:
        names = listed_adapters(await response.read())
    assert names is not None
    return names


async def test_a_load_over_the_budget_evicts_the_least_recently_used_idle_adapter(engine: SimInstance) -> None:
    fleet, endpoint = _fleet(engine, budget_mb=200)  # three 64 MB adapters fit, a fourth does not
    events: list[tuple[str, str]] = []
    async with UpstreamClient(read_timeout_s=10) as upstream:
        loader = AdapterLoader(
            upstream,
            on_event=lambda name, event: events.append((name, event)),
            clock=Clock(),
            budget_of=fleet_budget(fleet),
            adapter_of=fleet.adapter,
        )
        await loader.ensure(endpoint, PINNED, reason="preload")
        await loader.ensure(endpoint, A)
        await loader.ensure(endpoint, B)
        loader.begin(endpoint, A.name)  # A has a request in flight: of the idle ones, B is the least recently used
        await loader.ensure(endpoint, C)
        assert await _listed(engine.url) == {"pinned-lora", "a-lora", "c-lora"}
        assert ("b-lora", "evict") in events

        loader.end(endpoint, A.name)  # A idle again, used after C was loaded: C is the one to go now
        await loader.ensure(endpoint, D)
        assert await _listed(engine.url) == {"pinned-lora", "a-lora", "d-lora"}

        # everything left in use or preloaded: no room, the load fails as this endpoint's fault
        loader.begin(endpoint, A.name)
        loader.begin(endpoint, D.name)
        with pytest.raises(LoadFailed) as failed:
            await loader.ensure(endpoint, C)
        assert failed.value.status == 0 and "c-lora" in failed.value.message and "200 MB" in failed.value.message

        counts = loader.activity[endpoint.id]
        assert (counts.loads, counts.preloads, counts.evictions, counts.unloads, counts.failures) == (4, 1, 2, 0, 1)
        assert loader.pool_loads("base") == 4 and loader.pool_loads("other") == 0

        view = adapter_view(fleet, loader, 2000.0)
        pools = view["pools"]
        assert isinstance(pools, list) and len(pools) == 1
        pool = pools[0]
        assert pool["memory_budget_mb"] == 200.0 and pool["adapters"] == sorted(ADAPTERS)
        (replica,) = pool["replicas"]
        assert replica["evictions"] == 2 and replica["loads"] == 4 and replica["memory_used_mb"] == 192.0
        rows = {row["name"]: row for row in replica["adapters"]}
        assert set(rows) == {"pinned-lora", "a-lora", "d-lora"}
        assert rows["a-lora"]["held"] and rows["a-lora"]["inflight"] == 1 and rows["pinned-lora"]["preload"]


async def test_without_a_budget_nothing_is_evicted(engine: SimInstance) -> None:
    config = PoolConfig.model_validate(
        {"name": "base", "model": MODEL, "engine": "vllm", "endpoints": [{"url": engine.url}]}
    )
    pool = Pool(config)
    endpoint = Endpoint("base/both-s0", "base", engine.url, "vllm", MODEL, state=EndpointState.READY)
    pool.endpoints.append(endpoint)
    fleet = Fleet([pool])
    fleet.follow_adapters(lambda: ADAPTERS)
    async with UpstreamClient(read_timeout_s=10) as upstream:
        loader = AdapterLoader(upstream, clock=Clock(), budget_of=fleet_budget(fleet), adapter_of=fleet.adapter)
        for adapter in (A, B, C, D):
            await loader.ensure(endpoint, adapter)
    assert await _listed(engine.url) == {"a-lora", "b-lora", "c-lora", "d-lora"}
    assert loader.activity[endpoint.id].evictions == 0


async def test_the_pools_hottest_adapters_go_last(engine: SimInstance) -> None:
    fleet, endpoint = _fleet(engine, budget_mb=200)
    async with UpstreamClient(read_timeout_s=10) as upstream:
        loader = AdapterLoader(upstream, clock=Clock(), budget_of=fleet_budget(fleet), adapter_of=fleet.adapter)
        loader.kept = lambda e: frozenset({A.name})  # the keeper would preload it again at once
        for adapter in (A, B, C):
            await loader.ensure(endpoint, adapter)
        await loader.ensure(endpoint, D)  # A is the least recently used, but among the hottest: B goes
    assert await _listed(engine.url) == {"a-lora", "c-lora", "d-lora"}

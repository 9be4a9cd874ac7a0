"""A KV store shared by simulated engine processes (sim/kv_store.py): what one engine computed is
loaded by another instead of recomputed, at the store's link; both publish the store's blocks as KV
events of medium STORE; the store's LRU evictions reach every engine's view of it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from sim.config import build_engine_config
from sim.kv_cache import STORE_MEDIUM, WRITE_ON_COMPUTE, KVEvent, SharedStore
from sim.kv_store import MAX_HASHES, RemoteStore, StoreServer
from sim.server import start_instances, stop_instance
from tests.sim.conftest import chat_body, post_json
from tests.support.polling import wait_for_async
from tests.support.procs import free_port

PROMPT = "A store shared by the replicas keeps what any of them computed. " * 40
BYTES_PER_BLOCK = 16 * 128 * 1024  # llama-3.1-8b: 128 KiB of KV per token


async def serve_store(capacity_blocks: int) -> tuple[web.AppRunner, str, StoreServer]:
    server = StoreServer(SharedStore(capacity_blocks, 10e9, 1e-3, BYTES_PER_BLOCK, WRITE_ON_COMPUTE))
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}", server


@pytest.fixture
async def store() -> AsyncIterator[tuple[str, StoreServer]]:
    runner, url, server = await serve_store(100_000)
    try:
        yield url, server
    finally:
        await runner.cleanup()


async def test_a_prefix_one_engine_computed_is_loaded_by_the_other(
    http: aiohttp.ClientSession, store: tuple[str, StoreServer]
) -> None:
    url, server = store
    config = build_engine_config(time_scale=20, kv_store_url=url)
    assert config.kv_offload_blocks > 0  # a store is read after a DRAM tier: the engine gets one
    one, two = await start_instances(config, 2)
    try:
        first = await post_json(http, one.url + "/v1/chat/completions", chat_body(PROMPT, max_tokens=1))
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        prompt = first["usage"]["prompt_tokens"]
        whole = (prompt - 1) // 16
        assert two.engine.store is not None
        mirror = two.engine.store
        await wait_for_async(lambda: len(mirror.blocks) >= whole, what="the other engine's view of the store")
        again = await post_json(http, two.url + "/v1/chat/completions", chat_body(PROMPT, max_tokens=1))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == whole * 16  # loaded, not computed
        assert mirror.stats.loads == 1 and mirror.stats.loaded_blocks == whole
        await wait_for_async(lambda: server.store.stats.loads == 1, what="the store counting the read")
        assert len(server.store.blocks) == whole  # written once, by the engine that computed it
    finally:
        for instance in (one, two):
            await stop_instance(instance)


async def test_an_engine_publishes_the_store_blocks_and_the_stores_evictions() -> None:
    runner, url, _ = await serve_store(4)
    published: list[KVEvent] = []
    remote = RemoteStore(url, BYTES_PER_BLOCK, published.extend)
    await remote.start()
    try:
        await wait_for_async(lambda: remote.connected.is_set(), what="the feed's snapshot")
        assert (remote.capacity_blocks, remote.bandwidth, remote.latency_s) == (4, 10e9, 1e-3)  # the store's link
        remote.put([1, 2, 3])
        assert published == [KVEvent("stored", (1, 2, 3), medium=STORE_MEDIUM)]
        await wait_for_async(lambda: len(remote.blocks) == 3, what="the store's blocks in the mirror")
        remote.put([4, 5, 6])  # past the store's 4 blocks: 1 and 2 go
        await wait_for_async(lambda: list(remote.blocks) == [3, 4, 5, 6], what="the eviction in the mirror")
        assert KVEvent("removed", (1, 2), medium=STORE_MEDIUM) in published
        assert remote.run([3, 4, 9], 0, 3) == 2
        assert remote.load_s(2) == pytest.approx(1e-3 + 2 * BYTES_PER_BLOCK / 10e9)
    finally:
        await remote.stop()
        await runner.cleanup()


async def test_the_store_refuses_what_is_not_a_list_of_hashes_and_bounds_its_feeds(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, url, server = await serve_store(4)
    try:
        for body in (b"not json", b'{"hashes": "1,2"}', b'{"hashes": [1.5]}', b'{"hashes": [1, 2]} trailing'):
            async with http.post(url + "/put", data=body) as resp:
                assert resp.status == 400
        async with http.post(url + "/put", json={"hashes": list(range(MAX_HASHES + 1))}) as resp:
            assert resp.status == 400
        monkeypatch.setattr("sim.kv_store.MAX_FEEDS", 1)
        async with http.get(url + "/feed") as first:
            assert (await first.content.readline()).startswith(b'{"snapshot"')
            async with http.get(url + "/feed") as second:
                assert second.status == 503
        assert len(server._feeds) <= 1
    finally:
        await runner.cleanup()


async def test_an_engine_started_before_its_store_serves_and_joins_it_later(http: aiohttp.ClientSession) -> None:
    port = free_port()
    config = build_engine_config(time_scale=20, kv_store_url=f"http://127.0.0.1:{port}")
    (engine,) = await start_instances(config, 1)
    try:
        answer = await post_json(http, engine.url + "/v1/chat/completions", chat_body(PROMPT, max_tokens=1))
        assert answer["usage"]["completion_tokens"] == 1  # no store yet: the engine serves all the same
        server = StoreServer(SharedStore(1000, 10e9, 1e-3, BYTES_PER_BLOCK, WRITE_ON_COMPUTE))
        runner = web.AppRunner(server.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            store = engine.engine.store
            assert store is not None
            await wait_for_async(lambda: store.connected.is_set(), what="the engine joining the store")
            assert store.capacity_blocks == 1000
        finally:
            await runner.cleanup()
    finally:
        await stop_instance(engine)

"""KV cache events over a real ZMQ socket, in both wire shapes."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from backends.block_hash import hash_blocks
from backends.tokenization import chat_prompt_ids
from sim.server import run_sim_engines
from tests.sim.conftest import post_json
from tests.support.procs import free_port


async def _collect(sub: zmq.asyncio.Socket, until: Any, timeout_s: float = 5.0) -> list[list[bytes]]:
    messages: list[list[bytes]] = []
    async with asyncio.timeout(timeout_s):
        while not until(messages):
            messages.append(await sub.recv_multipart())
    return messages


@pytest.mark.parametrize("shape", ["tagged", "positional"])
@pytest.mark.slow
async def test_block_stored_events_match_the_prompt_blocks(shape: str, http: aiohttp.ClientSession) -> None:
    port = free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": "kv",
        "format": shape,
    }
    async with run_sim_engines(time_scale=20, kv_events_config=config) as (instance,):
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        await asyncio.sleep(0.3)  # let the subscription reach the publisher
        messages = [{"role": "user", "content": "event " * 100}]
        await post_json(
            http, instance.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "ignore_eos": True}
        )
        expected = hash_blocks(chat_prompt_ids(messages), 16)

        def stored(msgs: list[list[bytes]]) -> list[Any]:
            events = []
            for _topic, _seq, payload in msgs:
                _ts, batch, _rank = msgpack.unpackb(payload)
                events += batch
            return events

        def covers(msgs: list[list[bytes]]) -> bool:
            hashes = []
            for e in stored(msgs):
                kind = e["type"] if isinstance(e, dict) else e[0]
                if kind == "BlockStored":
                    hashes += e["block_hashes"] if isinstance(e, dict) else e[1]
            return set(expected) <= set(hashes)

        received = await _collect(sub, covers)
        sub.close()
    topic, seq, _payload = received[0]
    assert topic == b"kv" and int.from_bytes(seq, "big") == 0
    first = stored(received)[0]
    if shape == "tagged":
        assert first["type"] == "BlockStored" and first["medium"] == "GPU" and first["block_size"] == 16
        assert first["parent_block_hash"] is None
        assert first["block_hashes"] == expected[: len(first["block_hashes"])]
        assert first["token_ids"] == chat_prompt_ids(messages)[: 16 * len(first["block_hashes"])]
    else:
        assert first[0] == "BlockStored" and first[4] == 16 and first[6] == "GPU"


@pytest.mark.slow
async def test_reset_prefix_cache_publishes_all_blocks_cleared(http: aiohttp.ClientSession) -> None:
    port = free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    async with run_sim_engines(time_scale=20, kv_events_config=config) as (instance,):
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        await asyncio.sleep(0.3)
        async with http.post(instance.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        ((_topic, _seq, payload),) = await _collect(sub, lambda m: len(m) == 1)
        sub.close()
    assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]


async def test_replay_returns_buffered_batches_then_the_end_marker(http: aiohttp.ClientSession) -> None:
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv",
    }
    async with run_sim_engines(time_scale=20, kv_events_config=config) as (instance,):
        await post_json(
            http,
            instance.url + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "replay " * 60}], "max_tokens": 2},
        )
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        async with asyncio.timeout(5):
            while True:
                frames = await dealer.recv_multipart()
                replies.append(frames[1:])
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    break
        dealer.close()
    topic, seq, payload = replies[0]
    assert topic == b"kv" and int.from_bytes(seq, "big") == 0
    assert msgpack.unpackb(payload)[1][0]["type"] == "BlockStored"
    assert replies[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]

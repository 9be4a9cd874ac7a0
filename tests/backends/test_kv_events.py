"""KV events: decoding both vLLM shapes, and the subscriber over real ZMQ sockets feeding the precise index."""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import kv_events
from backends.block_hash import hash_blocks
from backends.kv_events import (
    MAX_MESSAGE_BYTES,
    RESET_GAP,
    RESET_RESTART,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventDecodeError,
    KvEventHub,
    KvEventSubscriber,
    decode_frames,
    decode_payload,
)
from backends.tokenization import chat_prompt_ids
from backends.types import Endpoint
from policies.routing.pipeline import ScoringRouter, build_router
from sim.server import run_sim_engines
from tests.policies.routing.factories import endpoint, pool, request, token_ids
from tests.support.polling import wait_for_async

PROMPT = token_ids(64)  # 4 blocks of 16
HASHES = hash_blocks(PROMPT, 16)
TIMEOUT_S = 5.0


def stored_map(first: int, last: int, *, digest: bool = False) -> dict[str, Any]:
    hashes: list[Any] = HASHES[first:last]
    if digest:
        hashes = [h.to_bytes(32, "big") for h in hashes]  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": HASHES[first - 1] if first else None,
        "token_ids": PROMPT[first * 16 : last * 16],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def stored_array(first: int, last: int) -> list[Any]:
    parent = HASHES[first - 1] if first else None
    return ["BlockStored", HASHES[first:last], parent, PROMPT[first * 16 : last * 16], 16, None, "GPU"]


def ids(tokens: list[int]) -> array[int]:
    """Token ids as the decoder keeps them (checked, and ready to hash)."""
    return array("I", tokens)


def payload(*events: Any) -> bytes:
    packed: bytes = msgpack.packb([1700000000.0, list(events), 0], use_bin_type=True)
    return packed


def frames(seq: int, *events: Any, topic: bytes = b"kv@a") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload(*events)]


# --- decoding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        pytest.param(stored_map(0, 2), BlockStored(HASHES[:2], None, ids(PROMPT[:32]), 16, "GPU"), id="stored-map"),
        pytest.param(stored_array(0, 2), BlockStored(HASHES[:2], None, ids(PROMPT[:32]), 16, "GPU"), id="stored-array"),
        pytest.param(
            stored_map(1, 2, digest=True),
            BlockStored([HASHES[1]], HASHES[0], ids(PROMPT[16:32]), 16, "GPU"),
            id="stored-digest-hashes",
        ),
        pytest.param({"type": "BlockRemoved", "block_hashes": HASHES[:1]}, BlockRemoved(HASHES[:1]), id="removed-map"),
        pytest.param(["BlockRemoved", HASHES[:1], "CPU"], BlockRemoved(HASHES[:1], "CPU"), id="removed-array"),
        pytest.param({"type": "AllBlocksCleared"}, AllBlocksCleared(), id="cleared-map"),
        pytest.param(["AllBlocksCleared"], AllBlocksCleared(), id="cleared-array"),
    ],
)
def test_decode_both_shapes(event: Any, expected: Any) -> None:
    _ts, events, dp_rank = decode_payload(payload(event))
    assert events == [expected] and dp_rank == 0


def test_decode_frames_and_unknown_events() -> None:
    batch = decode_frames(frames(7, {"type": "SomethingNew"}, stored_map(0, 1)))
    assert (batch.seq, batch.topic, len(batch.events)) == (7, "kv@a", 1)
    mapped = msgpack.packb({"ts": 1.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": 2})
    assert decode_payload(mapped) == (1.0, [AllBlocksCleared()], 2)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([b"t", b"\x00" * 8, b"\xc1"], id="not-msgpack"),
        pytest.param([b"t", b"\x00" * 4, payload()], id="short-seq"),
        pytest.param([b"t", b"\x00" * 8, msgpack.packb([1.0, 5, 0])], id="events-not-a-list"),
        pytest.param([b"t", b"\x00" * 8, payload({"block_hashes": []})], id="untagged-map"),
        pytest.param([b"only-one"], id="one-frame"),
    ],
)
def test_decode_errors(bad: list[bytes]) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_frames(bad)


# --- the subscriber over real sockets ------------------------------------------------------------------


class Recorder:
    def __init__(self, router: ScoringRouter | None = None) -> None:
        self.batches: list[KvEventBatch] = []
        self.resets: list[str] = []
        self.router = router
        self.changed = asyncio.Event()

    def on_batch(self, endpoint_id: str, batch: KvEventBatch) -> None:
        self.batches.append(batch)
        if self.router is not None:
            self.router.on_kv_batch(endpoint_id, batch)
        self.changed.set()

    def on_reset(self, endpoint_id: str, reason: str) -> None:
        self.resets.append(reason)
        if self.router is not None:
            self.router.on_kv_reset(endpoint_id, reason)
        self.changed.set()

    async def until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(TIMEOUT_S):
            while not done():
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def publisher() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    """An XPUB (a PUB that reports subscriptions, so tests need not sleep for the slow joiner)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    address = str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    yield sock, address
    sock.close(0)


async def start(sub: KvEventSubscriber, pub: zmq.asyncio.Socket) -> asyncio.Task[None]:
    task = asyncio.get_running_loop().create_task(sub.run())
    async with asyncio.timeout(TIMEOUT_S):
        assert (await pub.recv())[0] == 1  # the subscription arrived
    return task


async def stop(sub: KvEventSubscriber, task: asyncio.Task[None]) -> None:
    sub.stop()
    await asyncio.wait_for(task, TIMEOUT_S)


def endpoints() -> list[Endpoint]:
    return [endpoint(name, engine="sim", scraped_at_s=0.0) for name in ("a", "b")]


@pytest.mark.slow
async def test_subscriber_feeds_the_precise_index_in_both_shapes(publisher: tuple[zmq.asyncio.Socket, str]) -> None:
    pub, address = publisher
    router = build_router({"seed": 1, "prefix_index": {"mode": "precise", "advanced": {"precise_keys": "tokens"}}})
    rec = Recorder(router)
    sub = KvEventSubscriber("a", address, rec.on_batch, rec.on_reset, topic="kv@")
    task = await start(sub, pub)
    eps = endpoints()
    router.on_kv_batch("b", KvEventBatch(seq=0, ts=0.0, events=[]))  # b publishes too, holds nothing

    await pub.send_multipart(frames(0, stored_map(0, 2)))  # vLLM's tagged maps (0.32 sends these)
    await pub.send_multipart(frames(1, stored_array(2, 4)))  # older positional arrays, chained
    await pub.send_multipart(frames(2, {"type": "Ignored"}, topic=b"other-topic"))  # filtered by topic
    await rec.until(lambda: len(rec.batches) == 2)
    d = router.route(request(PROMPT), pool(eps), 0.0)
    assert d is not None and (d.endpoint.id, d.reason, d.cached_tokens_estimate) == ("a", "prefix-hit", 63)

    await pub.send_multipart(frames(2, ["BlockRemoved", HASHES[:1], "GPU"]))
    await rec.until(lambda: len(rec.batches) == 3)
    d = router.route(request(PROMPT), pool(eps), 0.0)
    assert d is not None and d.reason == "load" and d.cached_tokens_estimate == 0
    assert (sub.stats.batches, sub.stats.gaps, rec.resets) == (3, 0, [])
    await stop(sub, task)


@pytest.mark.slow
async def test_gap_without_replay_resets(publisher: tuple[zmq.asyncio.Socket, str]) -> None:
    pub, address = publisher
    rec = Recorder()
    sub = KvEventSubscriber("a", address, rec.on_batch, rec.on_reset)
    task = await start(sub, pub)
    await pub.send_multipart(frames(0, stored_map(0, 1)))
    await pub.send_multipart(frames(5, stored_map(1, 2)))  # 1..4 lost
    await pub.send_multipart(frames(0, ["AllBlocksCleared"]))  # sequence restarts: engine restarted
    await rec.until(lambda: len(rec.batches) == 3)
    assert rec.resets == [RESET_GAP, RESET_RESTART]
    assert [b.seq for b in rec.batches] == [0, 5, 0] and sub.stats.gaps == 1
    await pub.send_multipart([b"kv", b"\x00" * 8, b"\xc1"])  # garbage is counted, not fatal
    await pub.send_multipart(frames(1, ["AllBlocksCleared"]))
    await rec.until(lambda: len(rec.batches) == 4)
    assert sub.stats.decode_errors == 1
    await stop(sub, task)


async def serve_replay(
    router_sock: zmq.asyncio.Socket, buffer: dict[int, list[bytes]], served: list[int] | None = None
) -> None:
    """vLLM's replay server (0.32 as observed): [id, "", start] -> [id, "", topic, seq, payload]...
    then [id, "", "", -1, ""]."""
    while True:
        identity, _empty, start_frame = await router_sock.recv_multipart()
        start_seq = int.from_bytes(start_frame, "big")
        if served is not None:
            served.append(start_seq)
        for seq in sorted(buffer):
            if seq >= start_seq:
                await router_sock.send_multipart([identity, b"", *buffer[seq]])
        await router_sock.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


@pytest.mark.slow
async def test_gap_is_repaired_through_replay(publisher: tuple[zmq.asyncio.Socket, str]) -> None:
    pub, address = publisher
    replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind("tcp://127.0.0.1:*")
    buffer: dict[int, list[bytes]] = {}  # empty when the subscription starts: nothing to catch up
    served: list[int] = []
    server = asyncio.get_running_loop().create_task(serve_replay(replay, buffer, served))
    rec = Recorder()
    sub = KvEventSubscriber(
        "a", address, rec.on_batch, rec.on_reset, replay_address=str(replay.getsockopt_string(zmq.LAST_ENDPOINT))
    )
    task = await start(sub, pub)
    try:
        await wait_for_async(lambda: served == [0], timeout_s=TIMEOUT_S)  # the start-up catch-up found nothing
        buffer.update({seq: frames(seq, stored_map(seq, seq + 1)) for seq in range(4)})
        await pub.send_multipart(buffer[0])
        await pub.send_multipart(buffer[3])  # 1 and 2 missed: fetched from the replay socket
        await rec.until(lambda: len(rec.batches) == 4)
        assert [b.seq for b in rec.batches] == [0, 1, 2, 3]
        assert (rec.resets, sub.stats.gaps, sub.stats.replayed_batches) == ([], 1, 2)
    finally:
        await stop(sub, task)
        server.cancel()
        replay.close(0)


@pytest.mark.slow
async def test_a_late_subscription_catches_up_through_replay_at_once(
    publisher: tuple[zmq.asyncio.Socket, str],
) -> None:
    """The engine already holds blocks when the gateway subscribes: they are known before its next event."""
    pub, address = publisher
    replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind("tcp://127.0.0.1:*")
    buffer = {seq: frames(seq, stored_map(seq, seq + 1)) for seq in range(3)}
    server = asyncio.get_running_loop().create_task(serve_replay(replay, buffer))
    rec = Recorder()
    sub = KvEventSubscriber(
        "a", address, rec.on_batch, rec.on_reset, replay_address=str(replay.getsockopt_string(zmq.LAST_ENDPOINT))
    )
    task = await start(sub, pub)
    try:
        await wait_for_async(lambda: sub.stats.catch_ups == 1, timeout_s=TIMEOUT_S)  # no live batch was needed
        assert [b.seq for b in rec.batches] == [0, 1, 2]
        await pub.send_multipart(buffer[2])  # published while the replay ran: already delivered
        await pub.send_multipart(frames(3, stored_map(3, 4)))
        await rec.until(lambda: len(rec.batches) == 4)
        assert [b.seq for b in rec.batches] == [0, 1, 2, 3]
        assert (rec.resets, sub.stats.duplicates, sub.stats.gaps) == ([], 1, 0)
    finally:
        await stop(sub, task)
        server.cancel()
        replay.close(0)


@pytest.mark.slow
async def test_a_batch_the_slow_joiner_lost_is_caught_up_without_a_later_batch(
    publisher: tuple[zmq.asyncio.Socket, str],
) -> None:
    """The engine published its first batch after the start-up catch-up but before the subscription
    reached it (never delivered live), and publishes nothing more: the catch-up after `catch_up_s`
    fetches it, so the index is not left empty until the next event."""
    pub, address = publisher
    replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind("tcp://127.0.0.1:*")
    buffer: dict[int, list[bytes]] = {}
    served: list[int] = []
    server = asyncio.get_running_loop().create_task(serve_replay(replay, buffer, served))
    rec = Recorder()
    sub = KvEventSubscriber(
        "a",
        address,
        rec.on_batch,
        rec.on_reset,
        replay_address=str(replay.getsockopt_string(zmq.LAST_ENDPOINT)),
        catch_up_s=0.2,
    )
    task = await start(sub, pub)
    try:
        await wait_for_async(lambda: served == [0], timeout_s=TIMEOUT_S)  # the start-up catch-up: nothing yet
        buffer[0] = frames(0, stored_map(0, 3))  # published, but lost to the slow joiner
        await wait_for_async(lambda: sub.stats.catch_ups == 1, timeout_s=TIMEOUT_S)
        assert [b.seq for b in rec.batches] == [0]
        await pub.send_multipart(frames(1, stored_map(3, 4)))  # live from here on
        await rec.until(lambda: len(rec.batches) == 2)
        assert [b.seq for b in rec.batches] == [0, 1] and (rec.resets, sub.stats.gaps) == ([], 0)
    finally:
        await stop(sub, task)
        server.cancel()
        replay.close(0)


async def test_hub_follows_the_fleet(publisher: tuple[zmq.asyncio.Socket, str]) -> None:
    pub, address = publisher
    rec = Recorder()
    hub = KvEventHub(rec.on_batch, rec.on_reset)
    hub.sync([("a", address)])
    async with asyncio.timeout(TIMEOUT_S):
        await pub.recv()
    await pub.send_multipart(frames(0, stored_map(0, 1)))
    await rec.until(lambda: len(rec.batches) == 1)
    assert hub.stats()["a"].batches == 1
    hub.sync([])
    assert hub.stats() == {}
    await hub.close()


@pytest.mark.slow
async def test_simulated_engine_events_drive_routing() -> None:
    """A real simulated engine publishes its cache; the router sends the repeat prompt to it."""
    router = build_router({"seed": 1, "prefix_index": {"mode": "precise"}})
    rec = Recorder(router)
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)  # only to reserve a free port number
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    async with run_sim_engines(time_scale=20, kv_events_config=config) as (instance,):
        sub = KvEventSubscriber("a", f"tcp://127.0.0.1:{port}", rec.on_batch, rec.on_reset)
        task = asyncio.get_running_loop().create_task(sub.run())
        await asyncio.sleep(0.3)  # the engine's PUB cannot tell us when the subscription has arrived
        messages = [{"role": "user", "content": "route me " * 200}]
        async with (
            aiohttp.ClientSession() as http,
            http.post(instance.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}) as resp,
        ):
            assert resp.status == 200
        await rec.until(lambda: bool(rec.batches))
        ids = chat_prompt_ids(messages)
        d = router.route(request(ids), pool(endpoints()), rec.batches[-1].received_at_s)
        assert d is not None and d.endpoint.id == "a" and d.reason == "prefix-hit"
        assert d.cached_tokens_estimate == len(ids) // 16 * 16
        await stop(sub, task)


# --- what an engine publishes is input (bench/chaos/engine_channels.py) ------------------------------


def batch_of(event: Any, ts: Any = 1.0) -> list[bytes]:
    return [b"kv", (1).to_bytes(8, "big"), msgpack.packb([ts, [event], 0], use_bin_type=True)]


def with_field(name: str, value: Any) -> dict[str, Any]:
    return {**stored_map(0, 1), name: value}


@pytest.mark.parametrize(
    "bad",
    [
        # these raised ValueError / TypeError, not KvEventDecodeError: it escaped the subscriber's
        # `_handle` and ended its `run` loop (the endpoint's events silently stopped)
        pytest.param(batch_of(with_field("block_size", "16")), id="block-size-string"),
        pytest.param(batch_of(with_field("block_size", {"a": 1})), id="block-size-map"),
        pytest.param(batch_of(stored_map(0, 1), ts="now"), id="ts-string"),
        pytest.param(batch_of(stored_map(0, 1), ts={"a": 1}), id="ts-map"),
        # these decoded and reached the index: a negative or huge block size, ids that are not ids
        # ("consumer failed"), names that are not strings, extra keys that are not a list
        pytest.param(batch_of(with_field("block_size", -16)), id="block-size-negative"),
        pytest.param(batch_of(with_field("block_size", 1 << 40)), id="block-size-huge"),
        pytest.param(batch_of(with_field("block_size", 1.5)), id="block-size-float"),
        pytest.param(batch_of(stored_map(0, 1), ts=float("nan")), id="ts-nan"),
        pytest.param(batch_of(stored_map(0, 1), ts=float("inf")), id="ts-inf"),
        # a replayed batch from the far future made every later one look delivered (a duplicate)
        pytest.param(batch_of(stored_map(0, 1), ts=1e18), id="ts-far-future"),
        pytest.param(batch_of(with_field("token_ids", ["a"])), id="token-ids-strings"),
        pytest.param(batch_of(with_field("token_ids", [-1])), id="token-ids-negative"),
        pytest.param(batch_of(with_field("token_ids", [1 << 32])), id="token-ids-past-32-bits"),
        pytest.param(batch_of(with_field("token_ids", {"a": 1})), id="token-ids-map"),
        pytest.param(batch_of(with_field("medium", 5)), id="medium-int"),
        pytest.param(batch_of(with_field("medium", "G" * 5000)), id="medium-long"),
        pytest.param(batch_of({"type": "BlockRemoved", "block_hashes": [1], "medium": [1]}), id="removed-medium"),
        pytest.param(batch_of(with_field("lora_name", [1])), id="lora-name-list"),
        pytest.param(batch_of(with_field("extra_keys", {"a": 1})), id="extra-keys-map"),
        pytest.param(batch_of(with_field("extra_keys", 5)), id="extra-keys-int"),
        pytest.param(batch_of(["BlockStored", [1], None, [1], "x"]), id="array-block-size"),
        pytest.param([b"kv", (-5).to_bytes(8, "big", signed=True), payload()], id="seq-negative"),
        pytest.param([b"kv", ((1 << 63) - 1).to_bytes(8, "big"), payload()], id="seq-at-the-end"),
    ],
)
def test_fields_of_the_wrong_type_or_range_are_decode_errors(bad: list[bytes]) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_frames(bad)


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
FIELDS = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_name", "extra_keys")


@st.composite
def hostile_events(draw: st.DrawFn) -> Any:
    """A valid event with fields swapped for any msgpack value, or any value at all."""
    event: Any = draw(st.sampled_from((stored_map(0, 2), stored_array(1, 3), {"type": "BlockRemoved",
                                       "block_hashes": HASHES[:1]}, ["AllBlocksCleared"])))  # fmt: skip
    if isinstance(event, dict):
        event = dict(event)
        for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3)):
            event[name] = draw(MSGPACK_VALUES)
    elif draw(st.booleans()):
        event = list(event)
        event[draw(st.integers(0, len(event) - 1))] = draw(MSGPACK_VALUES)
    return draw(MSGPACK_VALUES) if draw(st.integers(0, 5)) == 0 else event


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(hostile_events(), max_size=4), MSGPACK_VALUES, st.integers(-(1 << 63), (1 << 63) - 1))
def test_any_message_decodes_or_is_a_decode_error_and_the_index_takes_what_decodes(
    events: list[Any], ts: Any, seq: int
) -> None:
    """The one promise of the decoder: KvEventDecodeError or a batch the precise index applies
    without raising (before: ValueError/TypeError escaped, or the index failed on what decoded)."""
    router = build_router({"seed": 1, "prefix_index": {"mode": "precise", "advanced": {"precise_keys": "tokens"}}})
    message = [b"kv", seq.to_bytes(8, "big", signed=True), msgpack.packb([ts, events, 0], use_bin_type=True)]
    try:
        batch = decode_frames(message)
    except KvEventDecodeError:
        return
    router.on_kv_batch("a", batch)
    router.on_kv_batch("a", batch)  # and again, now that the index knows the blocks


@pytest.mark.slow
async def test_a_subscriber_outlives_any_message_and_applies_the_next_valid_one(
    publisher: tuple[zmq.asyncio.Socket, str],
) -> None:
    pub, address = publisher
    rec = Recorder()
    sub = KvEventSubscriber("a", address, rec.on_batch, rec.on_reset)
    task = await start(sub, pub)
    await pub.send_multipart(frames(0, stored_map(0, 1)))
    await pub.send_multipart(batch_of(with_field("block_size", "16")))  # ended `run` before
    await pub.send_multipart(batch_of(stored_map(0, 1), ts={"a": 1}))
    await pub.send_multipart([b"kv", b"\x00" * 8, payload(), *([b"x"] * 1000)])  # a message of 1003 frames
    await pub.send_multipart(frames(1, stored_map(1, 2)))
    await rec.until(lambda: len(rec.batches) == 2)
    assert [b.seq for b in rec.batches] == [0, 1] and sub.stats.decode_errors == 3
    # past MAXMSGSIZE: ZMQ drops the connection and would never reconnect (the subscription dead
    # for good); a new socket connects, and a batch published once it has is applied
    await pub.send_multipart([b"kv", b"\x00" * 8, b"\x00" * (MAX_MESSAGE_BYTES + 1)])
    await wait_for_async(lambda: sub.stats.disconnects == 1, timeout_s=TIMEOUT_S)
    seq = 2
    async with asyncio.timeout(TIMEOUT_S):
        while rec.batches[-1].seq == 1:  # sent until the new connection has subscribed
            await pub.send_multipart(frames(seq, stored_map(2, 3)))
            seq += 1
            await asyncio.sleep(0.05)
    assert not task.done() and sub.stats.running
    await stop(sub, task)


async def endless_replay(router_sock: zmq.asyncio.Socket, seq: int | None) -> None:
    """A replay socket that never sends the end marker: the same old batch (`seq`), or garbage, forever."""
    identity, _empty, _start = await router_sock.recv_multipart()
    message = [b"kv", b"\x00\x00", b"?"] if seq is None else frames(seq, stored_map(0, 1))
    with contextlib.suppress(zmq.ZMQError):
        while True:
            await router_sock.send_multipart([identity, b"", *message])
            await asyncio.sleep(0)  # a ROUTER send never blocks: let the subscriber run


@pytest.mark.slow
@pytest.mark.parametrize("seq", [0, None], ids=["old-batch-forever", "garbage-forever"])
async def test_a_replay_that_answers_forever_does_not_hold_the_subscription(
    publisher: tuple[zmq.asyncio.Socket, str], monkeypatch: pytest.MonkeyPatch, seq: int | None
) -> None:
    """Before, a replay answering batches older than asked for kept `_replay` reading for ever: the
    live stream was never read again."""
    monkeypatch.setattr(kv_events, "MAX_REPLAY_BATCHES", 50)
    pub, address = publisher
    replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind("tcp://127.0.0.1:*")
    rec = Recorder()
    sub = KvEventSubscriber(
        "a", address, rec.on_batch, rec.on_reset, replay_address=str(replay.getsockopt_string(zmq.LAST_ENDPOINT))
    )
    task = await start(sub, pub)
    await pub.send_multipart(frames(0, stored_map(0, 1)))
    await rec.until(lambda: len(rec.batches) >= 1)
    server = asyncio.get_running_loop().create_task(endless_replay(replay, seq))
    try:
        await pub.send_multipart(frames(5, stored_map(1, 2)))  # a gap: asks the replay socket
        await rec.until(lambda: rec.batches[-1].seq == 5)
        assert rec.resets == [RESET_GAP]  # the missing batches never came
        await pub.send_multipart(frames(6, stored_map(2, 3)))
        await rec.until(lambda: rec.batches[-1].seq == 6)
    finally:
        await stop(sub, task)
        server.cancel()
        replay.close(0)

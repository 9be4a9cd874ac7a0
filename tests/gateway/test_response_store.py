"""The Responses store, in memory and in Redis: bounds are per owner (a key over its own bounds loses
its own oldest responses, never another key's), a key reads only its own ids, and a string that is
not one of the gateway's ids is looked up nowhere (it never names the store's own records)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.apis.store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    StoreUnavailable,
    entry_blob,
    is_response_id,
    new_response_id,
)
from gateway.app.settings import ResponseStoreSettings
from tests.support.procs import free_port

SETTINGS = ResponseStoreSettings(max_responses_per_key=5, max_bytes_per_key=64 * 1024, max_response_bytes=32 * 1024)


NOT_ENTRIES = [
    b"not json",
    b"[1, 2]",
    b'{"response": "text", "items": []}',
    b'{"response": {}, "items": [1]}',
    b'{"response": {}, "items": [], "program": 5}',
]


def blob(size: int) -> bytes:
    return entry_blob(b'{"id":"x","pad":"' + b"a" * size + b'"}', [])


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ResponseStore]:
    if request.param == "memory":
        yield MemoryResponseStore(SETTINGS)
        return
    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("redis_prefix")
    opened = RedisResponseStore.from_url(url, SETTINGS, prefix)
    yield opened
    await opened.close()


async def test_one_keys_many_responses_evict_only_its_own(store: ResponseStore) -> None:
    neighbour = new_response_id()
    assert await store.put("b", neighbour, blob(100))
    mine = [new_response_id() for _ in range(40)]
    for response_id in mine:  # 40 x 20 KB: over its count (5) and its bytes (64 KB) many times
        assert await store.put("a", response_id, blob(20 * 1024))
    assert await store.get("b", neighbour) is not None
    kept = [r for r in mine if await store.get("a", r) is not None]
    assert kept == mine[-len(kept) :] and 1 <= len(kept) <= 3  # its newest, within its 64 KB
    assert await store.get("a", mine[-1]) is not None  # the one just stored is never the one dropped


async def test_a_key_reads_and_deletes_only_its_own_ids(store: ResponseStore) -> None:
    response_id = new_response_id()
    assert await store.put("a", response_id, blob(10))
    assert await store.get("b", response_id) is None
    assert not await store.delete("b", response_id)
    assert await store.get("a", response_id) is not None
    assert await store.delete("a", response_id)
    assert await store.get("a", response_id) is None


async def test_too_large_for_the_key_is_not_stored(store: ResponseStore) -> None:
    assert not await store.put("a", new_response_id(), blob(40 * 1024))  # over max_response_bytes


async def test_strings_that_are_not_response_ids_name_nothing(store: ResponseStore) -> None:
    kept = new_response_id()
    assert await store.put("a", kept, blob(10))
    for probe in ("index", "sizes", "../index", "resp_x:index", "resp_" + "a" * 80, "", "resp_"):
        assert not is_response_id(probe)
        assert await store.get("a", probe) is None
        assert not await store.delete("a", probe)
    assert await store.get("a", kept) is not None  # nothing above touched the key's records


def test_response_ids_are_random_and_url_safe() -> None:
    ids = {new_response_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(is_response_id(i) and len(i) >= 5 + 24 for i in ids)


async def test_a_full_process_store_refuses_new_entries_instead_of_evicting_others() -> None:
    now = [0.0]
    settings = ResponseStoreSettings(max_responses=4, max_responses_per_key=3, ttl_s=100.0)
    store = MemoryResponseStore(settings, clock=lambda: now[0])
    others = [new_response_id() for _ in range(3)]
    for response_id in others:
        assert await store.put("b", response_id, blob(10))
    assert await store.put("a", first := new_response_id(), blob(10))
    assert not await store.put("c", new_response_id(), blob(10))  # full: not stored, nobody evicted
    assert store.refused == 1
    assert all([await store.get("b", r) is not None for r in others])
    assert await store.put("a", second := new_response_id(), blob(10)) is False  # over the process bound too
    assert await store.get("a", first) is not None
    now[0] = 150.0  # everything expired: a full store sweeps them before refusing
    assert await store.put("c", third := new_response_id(), blob(10))
    assert await store.get("c", third) is not None and await store.get("a", second) is None
    assert store.owned("b") == (0, 0) and len(store) == 1


@pytest.mark.redis
@pytest.mark.parametrize("corrupt", ["index", "sizes"])
async def test_the_owners_keys_of_another_type_or_sizes_that_are_not_numbers_are_repaired(
    redis_url: str, redis_prefix: str, corrupt: str
) -> None:
    """What Redis holds is input: an owner's index or sizes key of another type (or a size that is not
    a number) is replaced by the store script, so the owner's responses are kept again and its bounds
    hold, rather than every `store: true` answer failing."""
    store = RedisResponseStore.from_url(redis_url, SETTINGS, redis_prefix)
    try:
        assert await store.put("a", new_response_id(), blob(10))
        key = store._index("a") if corrupt == "index" else store._sizes("a")
        await store.client.delete(key)
        await store.client.set(key, "written by something else")
        kept = new_response_id()
        assert await store.put("a", kept, blob(10))
        await store.client.hset(store._sizes("a"), mapping={"resp_x": "nan", "resp_y": "-5", "resp_z": "text"})
        for _ in range(10):
            assert await store.put("a", new_response_id(), blob(10))
        assert await store.client.zcard(store._index("a")) <= SETTINGS.max_responses_per_key
        assert store.failures == 0
    finally:
        await store.close()


@pytest.mark.redis
@pytest.mark.parametrize("stored", NOT_ENTRIES)
async def test_an_entry_that_is_not_one_reads_as_not_found(redis_url: str, redis_prefix: str, stored: bytes) -> None:
    store = RedisResponseStore.from_url(redis_url, SETTINGS, redis_prefix)
    try:
        response_id = new_response_id()
        await store.client.set(store._key("a", response_id), stored)
        assert await store.get("a", response_id) is None
        await store.client.delete(store._key("a", response_id))
        await store.client.rpush(store._key("a", response_id), b"x")  # a key of another type
        assert await store.get("a", response_id) is None
        assert await store.delete("a", response_id)  # the key is the entry's: deleting it is the repair
    finally:
        await store.close()


async def test_a_redis_that_does_not_answer_costs_the_store_not_the_answer() -> None:
    """`put` says the response was not kept (the answer still goes out), a read is a 503 to retry."""
    store = RedisResponseStore.from_url(f"redis://127.0.0.1:{free_port()}/0", SETTINGS, "gone")
    try:
        assert not await store.put("a", new_response_id(), blob(10))
        with pytest.raises(StoreUnavailable) as raised:
            await store.get("a", new_response_id())
        assert raised.value.status == 503 and raised.value.code == "store_unavailable"
        with pytest.raises(StoreUnavailable):
            await store.delete("a", new_response_id())
    finally:
        await store.close()

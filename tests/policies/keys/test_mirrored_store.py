"""Redis with a durable SQLite copy behind it: a Redis that lost everything (a flush here, as a
restart without persistence leaves it) gets the copy back, once however many replicas notice
together, with revocations kept; a fresh Redis (no copy anywhere) stays empty."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml

from policies.keys.directory import KeyDirectory
from policies.keys.store import KeyStoreDamaged, MirroredDirectoryStore, RedisDirectoryStore, SqliteDirectoryStore
from policies.loader import parse_config
from policies.policy import Policy

pytestmark = pytest.mark.redis

POLICY: dict[str, dict[str, dict[str, str]]] = {"tenants": {"t": {}}, "models": {"m": {}}}


def mirrored(redis_url: str, prefix: str, path: Path) -> MirroredDirectoryStore:
    return MirroredDirectoryStore(RedisDirectoryStore.from_url(redis_url, prefix), SqliteDirectoryStore(path))


async def wipe(redis_url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        found = [key async for key in client.scan_iter(match=f"*{prefix}*")]
        if found:
            await client.delete(*found)
    finally:
        await client.aclose()


async def test_an_emptied_redis_gets_the_copy_back_once(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    writer = KeyDirectory(mirrored(redis_url, redis_prefix, tmp_path / "a.sqlite3"))
    await writer.start()
    try:
        policy = Policy(parse_config(yaml.safe_dump(POLICY)), directory=writer)
        _, kept = await writer.create_key({"tenant": "t", "id": "kept"}, policy, ["m"])
        _, gone = await writer.create_key({"tenant": "t", "id": "gone"}, policy, ["m"])
        await writer.revoke_key("gone")
    finally:
        await writer.stop()
    await wipe(redis_url, redis_prefix)

    # two replicas with the same copy load together: one restores, both see every key
    stores = [mirrored(redis_url, redis_prefix, tmp_path / "a.sqlite3") for _ in range(2)]
    snapshots = await asyncio.gather(*(store.load() for store in stores))
    assert sum(store.restored for store in stores) == 1
    for snapshot in snapshots:
        assert set(snapshot.docs["key"]) == {"kept", "gone"} and snapshot.version >= 3
    reader = KeyDirectory(stores[0])
    await reader.start()
    try:
        policy = Policy(parse_config(yaml.safe_dump(POLICY)), directory=reader)
        assert policy.authenticate(kept) is not None
        assert policy.authenticate(gone) is None  # revoked stays revoked
    finally:
        await reader.stop()
        await stores[1].close()


async def test_a_replica_without_a_copy_restores_nothing(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    store = mirrored(redis_url, redis_prefix, tmp_path / "fresh.sqlite3")
    try:
        snapshot = await store.load()
        assert snapshot.version == 0 and not any(snapshot.docs.values()) and store.restored == 0
    finally:
        await store.close()


async def test_a_write_to_an_emptied_redis_restores_the_copy_first(
    redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    directory = KeyDirectory(mirrored(redis_url, redis_prefix, tmp_path / "c.sqlite3"))
    await directory.start()
    try:
        policy = Policy(parse_config(yaml.safe_dump(POLICY)), directory=directory)
        _, first = await directory.create_key({"tenant": "t", "id": "first"}, policy, ["m"])
        await wipe(redis_url, redis_prefix)  # before any reload notices
        await directory.create_key({"tenant": "t", "id": "second"}, policy, ["m"])
        snapshot = await directory.store.load()
        assert set(snapshot.docs["key"]) == {"first", "second"}
        assert policy.authenticate(first) is not None
    finally:
        await directory.stop()


@pytest.mark.parametrize("damage", ["version is no count", "keys of another type", "both"])
async def test_a_damaged_redis_is_repaired_from_the_copy_and_a_healthy_hash_is_kept(
    redis_url: str, redis_prefix: str, tmp_path: Path, damage: str
) -> None:
    """Redis holds what no replica writes there (a hand edit, another program on the prefix): the
    damaged parts come back from the copy, the healthy ones stay as they are (they may be newer than
    the copy: a revocation made since must not be undone), and writes work again."""
    directory = KeyDirectory(mirrored(redis_url, redis_prefix, tmp_path / "d.sqlite3"))
    await directory.start()
    client = aioredis.Redis.from_url(redis_url)
    try:
        policy = Policy(parse_config(yaml.safe_dump(POLICY)), directory=directory)
        _, kept = await directory.create_key({"tenant": "t", "id": "kept"}, policy, ["m"])
        await directory.create_tenant({"name": "made"}, policy, ["m"])
        tag = "{" + redis_prefix + "}:dir:"
        if damage != "keys of another type":
            await client.set(tag + "version", "nan")
        if damage != "version is no count":
            await client.delete(tag + "keys")
            await client.rpush(tag + "keys", "junk")
        await client.hset(tag + "tenants", "newer", '{"not": "in the copy"}')  # a healthy hash's own
        _, second = await directory.create_key({"tenant": "t", "id": "second"}, policy, ["m"])
        snapshot = await directory.store.load()
        assert not snapshot.damaged and snapshot.version > 0
        assert set(snapshot.docs["key"]) == {"kept", "second"}
        assert set(snapshot.docs["tenant"]) == {"made", "newer"}  # kept as Redis had it
        assert policy.authenticate(kept) is not None and policy.authenticate(second) is not None
    finally:
        await client.aclose()
        await directory.stop()


async def test_last_use_times_that_are_not_times_are_ignored_and_replaced(redis_url: str, redis_prefix: str) -> None:
    store = RedisDirectoryStore.from_url(redis_url, redis_prefix)
    client = aioredis.Redis.from_url(redis_url)
    tag = "{" + redis_prefix + "}:dir:"
    try:
        await client.hset(tag + "last_used", mapping={"a": "nan", "b": "text", "c": "5"})
        assert await store.last_used() == {"c": 5.0}
        await store.touch({"a": 10.0, "b": 20.0})
        assert await store.last_used() == {"a": 10.0, "b": 20.0, "c": 5.0}
        await client.delete(tag + "last_used")
        await client.set(tag + "last_used", "a string")
        assert await store.last_used() == {}
        await store.touch({"a": 30.0})
        assert await store.last_used() == {"a": 30.0}
    finally:
        await client.aclose()
        await store.close()


async def test_a_version_of_another_type_is_repaired_too(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    directory = KeyDirectory(mirrored(redis_url, redis_prefix, tmp_path / "e.sqlite3"))
    await directory.start()
    client = aioredis.Redis.from_url(redis_url)
    try:
        policy = Policy(parse_config(yaml.safe_dump(POLICY)), directory=directory)
        _, kept = await directory.create_key({"tenant": "t", "id": "kept"}, policy, ["m"])
        version = "{" + redis_prefix + "}:dir:version"
        await client.delete(version)
        await client.sadd(version, "junk")
        await directory.create_key({"tenant": "t", "id": "second"}, policy, ["m"])
        snapshot = await directory.store.load()
        assert not snapshot.damaged and set(snapshot.docs["key"]) == {"kept", "second"}
        assert policy.authenticate(kept) is not None
    finally:
        await client.aclose()
        await directory.stop()


async def test_a_damaged_copy_is_set_aside_and_rebuilt_from_redis(
    redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    """With Redis holding the store, a local copy SQLite cannot read does not stop start-up: the
    file is set aside for the operator and the copy written again from Redis, keys all there."""
    path = tmp_path / "d.sqlite3"
    writer = KeyDirectory(mirrored(redis_url, redis_prefix, path))
    await writer.start()
    try:
        policy = Policy(parse_config(yaml.safe_dump(POLICY)), directory=writer)
        _, secret = await writer.create_key({"tenant": "t", "id": "kept"}, policy, ["m"])
    finally:
        await writer.stop()
    path.write_bytes(b"not a database" * 300)

    store = MirroredDirectoryStore.beside(RedisDirectoryStore.from_url(redis_url, redis_prefix), path)
    assert store.copy is None and store.damaged is not None
    reader = KeyDirectory(store)
    await reader.start()
    try:
        policy = Policy(parse_config(yaml.safe_dump(POLICY)), directory=reader)
        assert policy.authenticate(secret) is not None and store.rebuilt == 1
        assert (tmp_path / "d.sqlite3.corrupt-1").read_bytes().startswith(b"not a database")
    finally:
        await reader.stop()
    again = SqliteDirectoryStore(path)  # the rebuilt copy reads whole, with the key in it
    try:
        assert set((await again.load()).docs["key"]) == {"kept"}
    finally:
        await again.close()


def set_aside_files(folder: Path) -> list[Path]:
    return list(folder.glob("*.corrupt-*"))


async def test_a_damaged_copy_with_an_empty_redis_stops_start_up(
    redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    """Nothing holds the keys: start-up stops with the copy's one line, the file left as it is."""
    path = tmp_path / "e.sqlite3"
    path.write_bytes(b"not a database" * 300)
    store = MirroredDirectoryStore.beside(RedisDirectoryStore.from_url(redis_url, redis_prefix), path)
    try:
        with pytest.raises(KeyStoreDamaged, match="cannot be read"):
            await store.load()
        assert path.read_bytes().startswith(b"not a database") and not set_aside_files(tmp_path)
    finally:
        await store.close()

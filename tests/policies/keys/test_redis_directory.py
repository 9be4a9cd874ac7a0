"""Two directories sharing one Redis (two gateway replicas): a write on one is applied by the other
through the announcement, and a missed announcement is repaired by the version poll."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import yaml

from policies.keys.directory import KeyDirectory
from policies.keys.store import RedisDirectoryStore
from policies.loader import parse_config
from policies.policy import Policy
from tests.support.polling import wait_for_async

pytestmark = pytest.mark.redis

POLICY: dict[str, dict[str, dict[str, str]]] = {"tenants": {"t": {}}, "models": {"m": {}}}


Replica = tuple[KeyDirectory, Policy]


@pytest.fixture
async def replicas(redis_url: str, redis_prefix: str) -> AsyncIterator[tuple[Replica, Replica]]:
    """Two gateway replicas' directories on one Redis, stopped after the test."""
    started: list[KeyDirectory] = []

    async def replica() -> Replica:
        directory = KeyDirectory(RedisDirectoryStore.from_url(redis_url, redis_prefix))
        started.append(directory)
        await directory.start()
        return directory, Policy(parse_config(yaml.safe_dump(POLICY)), directory=directory)

    try:
        yield await replica(), await replica()
    finally:
        for directory in started:
            await directory.stop()


async def test_a_key_made_on_one_replica_works_and_dies_on_the_other(replicas: tuple[Replica, Replica]) -> None:
    (a, pa), (_, pb) = replicas
    _, secret = await a.create_key({"tenant": "t", "id": "k1"}, pa, ["m"])
    await wait_for_async(lambda: pb.authenticate(secret) is not None)
    await a.revoke_key("k1")
    await wait_for_async(lambda: pb.authenticate(secret) is None)


async def test_a_missed_announcement_is_repaired_by_the_poll(
    replicas: tuple[Replica, Replica], redis_url: str, redis_prefix: str
) -> None:
    (a, pa), (b, pb) = replicas
    _, secret = await a.create_key({"tenant": "t", "id": "k1"}, pa, ["m"])
    await wait_for_async(lambda: pb.authenticate(secret) is not None)
    # a write announced nowhere (as if b's subscriber was reconnecting): only the version moves
    store = RedisDirectoryStore.from_url(redis_url, redis_prefix)
    store.channel += ":nobody-listens"
    revoked = a.keys["k1"].model_copy(update={"revoked_at_unix_s": time.time()})
    await store.write("key", "k1", revoked.model_dump_json())
    await store.close()
    await wait_for_async(lambda: pb.authenticate(secret) is None)
    assert b.stats["reloads"] >= 2

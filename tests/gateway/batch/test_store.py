"""The batch store contract, on disk and in Redis: files, quotas, claims, write-ahead results, restarts."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
import pytest

from gateway.batch.disk import DiskBatchStore, StoreLocked
from gateway.batch.objects import BatchMeta, FileMeta, new_batch_id, new_file_id
from gateway.batch.redis_store import RedisBatchStore
from gateway.batch.store import BatchStore, LineResult, QuotaExceeded, answered

Opener = Callable[[], BatchStore]


@pytest.fixture(params=["disk", pytest.param("redis", marks=pytest.mark.redis)])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens the store afresh each call (a restart); the same data behind it."""
    if request.param == "disk":
        return lambda: DiskBatchStore(tmp_path / "batch", fsync=True)
    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("redis_prefix")
    return lambda: RedisBatchStore.from_url(url, prefix, tmp_path / "scratch")


@pytest.fixture
async def store(opener: Opener) -> AsyncIterator[BatchStore]:
    opened = opener()
    yield opened
    await opened.close()


def lines(n: int) -> list[bytes]:
    return [
        orjson.dumps(
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}
        )
        for i in range(n)
    ]


async def add_file(
    store: BatchStore, n: int, *, owner: str = "k1", tenant: str = "t1", limits: tuple[int, int] = (0, 0)
) -> FileMeta:
    rows = lines(n)
    content = b"\n".join(rows) + b"\n"
    path = store.scratch() / f"in-{new_file_id()}"
    path.write_bytes(content)
    spans: list[int] = []
    offset = 0
    for row in rows:
        spans += [offset, len(row)]
        offset += len(row) + 1
    now = int(time.time())
    meta = FileMeta(new_file_id(), owner, tenant, "in.jsonl", "batch", len(content), now, now + 3600, lines=n)
    await store.add_file(meta, path, spans, limits=limits)
    return meta


async def add_batch(store: BatchStore, file: FileMeta, status: str = "in_progress") -> BatchMeta:
    now = int(time.time())
    meta = BatchMeta(new_batch_id(), file.owner, file.tenant, "/v1/embeddings", file.id, now, now + 86400, file.lines)
    meta.status = status  # type: ignore[assignment]
    await store.add_batch(meta)
    return meta


def result(i: int, ok: bool = True) -> LineResult:
    body = orjson.dumps({"object": "list", "usage": {"prompt_tokens": 3, "total_tokens": 3}})
    return answered(i, f"c{i}", 200 if ok else 400, f"r{i}", body)


async def test_file_round_trip_and_listing(store: BatchStore) -> None:
    first = await add_file(store, 3)
    second = await add_file(store, 2)
    other = await add_file(store, 1, owner="k2")
    assert [f.id for f in await store.list_files("k1")] == [second.id, first.id]  # newest first
    assert [f.id for f in await store.list_files("k2")] == [other.id]
    got = await store.get_file(first.id)
    assert got is not None and got.lines == 3 and got.bytes == first.bytes
    assert await store.read_lines(first.id, [2, 0]) == [lines(3)[2], lines(3)[0]]
    content = b"".join([chunk async for chunk in store.content(first.id)])
    assert content == b"\n".join(lines(3)) + b"\n"
    assert await store.content_bytes(first.id) == first.bytes == len(content)
    assert await store.delete_file(first.id)
    assert not await store.delete_file(first.id)
    assert await store.get_file(first.id) is None


async def test_tenant_quota_bounds_files_and_bytes(store: BatchStore) -> None:
    one = await add_file(store, 2, limits=(2, 10_000))
    await add_file(store, 2, limits=(2, 10_000))
    with pytest.raises(QuotaExceeded):
        await add_file(store, 2, limits=(2, 10_000))
    await add_file(store, 2, tenant="t2", limits=(2, 10_000))  # another tenant's own bound
    await store.delete_file(one.id)
    await add_file(store, 2, limits=(2, 10_000))
    with pytest.raises(QuotaExceeded):
        await add_file(store, 400, tenant="t3", limits=(10, 1000))  # bytes


async def test_claims_never_hand_out_a_line_twice(store: BatchStore) -> None:
    batch = await add_batch(store, await add_file(store, 10))
    first = await store.claim(batch.id, 4, 60)
    second = await store.claim(batch.id, 10, 60)
    assert sorted(first + second) == list(range(10))
    assert await store.claim(batch.id, 5, 60) == []
    assert await store.held(batch.id) == 10
    await store.defer(batch.id, [first[0]], 0)
    assert await store.claim(batch.id, 5, 60) == [first[0]]


@pytest.mark.slow
async def test_deferred_lines_wait_their_delay(store: BatchStore) -> None:
    batch = await add_batch(store, await add_file(store, 2))
    got = await store.claim(batch.id, 2, 60)
    await store.defer(batch.id, got, 0.3)
    assert await store.claim(batch.id, 2, 60) == []
    deadline = time.monotonic() + 10
    again: list[int] = []
    while time.monotonic() < deadline and len(again) < 2:
        again += await store.claim(batch.id, 2, 60)
        await asyncio.sleep(0.05)
    assert sorted(again) == got


async def test_a_line_is_recorded_once(store: BatchStore) -> None:
    batch = await add_batch(store, await add_file(store, 3))
    await store.claim(batch.id, 3, 60)
    assert await store.record(batch.id, [result(0), result(1, ok=False)]) == [True, True]
    assert await store.record(batch.id, [result(0)]) == [False]
    counts = await store.counts(batch.id)
    assert (counts.completed, counts.failed, counts.input_tokens) == (1, 1, 3)
    assert await store.held(batch.id) == 1
    assert await store.unrecorded(batch.id) == [2]
    assert [r.index for r in [r async for r in store.results(batch.id)]] == [0, 1]


async def test_progress_survives_a_restart(opener: Opener) -> None:
    store = opener()
    batch = await add_batch(store, await add_file(store, 5))
    claimed = await store.claim(batch.id, 5, 1.0)
    await store.record(batch.id, [result(claimed[0]), result(claimed[1])])
    await store.close()  # the process ends with three lines in flight
    store = opener()
    try:
        assert (await store.counts(batch.id)).completed == 2
        deadline = time.monotonic() + 10  # Redis: the dead claimant's lease runs out first
        again: list[int] = []
        while time.monotonic() < deadline and len(again) < 3:
            again += await store.claim(batch.id, 5, 60)
            await asyncio.sleep(0.1)
        assert sorted(again) == sorted(claimed[2:])  # the lines in flight, and only they, run again
        assert sorted([r.index async for r in store.results(batch.id)]) == sorted(claimed[:2])
    finally:
        await store.close()


async def test_status_changes_are_compare_and_set(store: BatchStore) -> None:
    batch = await add_batch(store, await add_file(store, 1), status="validating")
    moved = await store.update_batch(batch.id, {"validating"}, status="in_progress", in_progress_at=1)
    assert moved is not None and moved.status == "in_progress"
    assert await store.update_batch(batch.id, {"validating"}, status="failed") is None
    assert batch.id in await store.active_batches()
    await store.update_batch(batch.id, {"in_progress"}, status="completed", completed_at=5)
    assert batch.id not in await store.active_batches()
    assert batch.id in await store.expired_batches(10)
    await store.delete_batch(batch.id)
    assert await store.get_batch(batch.id) is None


async def test_locks_exclude_each_other(store: BatchStore) -> None:
    assert await store.lock("finalize:x", 30)
    assert not await store.lock("finalize:x", 30)
    await store.unlock("finalize:x")
    assert await store.lock("finalize:x", 30)


async def test_a_torn_record_is_cut_off_at_start_up(tmp_path: Path) -> None:
    store = DiskBatchStore(tmp_path / "b")
    batch = await add_batch(store, await add_file(store, 3))
    await store.claim(batch.id, 3, 60)
    await store.record(batch.id, [result(0)])
    await store.close()
    wal = tmp_path / "b" / "batches" / f"{batch.id}.wal"
    wal.write_bytes(wal.read_bytes() + result(1).record()[:-7])  # the crash came mid-write
    store = DiskBatchStore(tmp_path / "b")
    try:
        assert (await store.counts(batch.id)).completed == 1
        assert sorted(await store.claim(batch.id, 3, 60)) == [1, 2]
        assert await store.record(batch.id, [result(1)]) == [True]
        assert [r.index async for r in store.results(batch.id)] == [0, 1]
    finally:
        await store.close()


async def test_results_the_disk_refused_are_written_once_when_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk refuses the results log: the results wait (the caller's `record` with them) and
    are written when it is back, once each. Failing them made the runner run those lines again,
    their engine calls made and billed twice, while the buffered first copy still reached the log."""
    store = DiskBatchStore(tmp_path / "b", fsync=True)
    batch = await add_batch(store, await add_file(store, 3))
    await store.claim(batch.id, 3, 60)
    real_fsync = os.fsync
    refusals = [0]

    def full_disk(fd: int) -> None:
        if refusals[0] < 2:
            refusals[0] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    try:
        assert await asyncio.wait_for(store.record(batch.id, [result(0), result(1)]), 30) == [True, True]
        assert refusals[0] == 2
        assert [r.index async for r in store.results(batch.id)] == [0, 1]
        wal = tmp_path / "b" / "batches" / f"{batch.id}.wal"
        records = wal.read_bytes().splitlines(keepends=True)
        read = [LineResult.read(r) for r in records]
        assert [r.index if r is not None else None for r in read] == [0, 1]  # each once, nothing torn
        assert await store.unrecorded(batch.id) == [2]
    finally:
        await store.close()


async def test_one_process_owns_a_directory(tmp_path: Path) -> None:
    store = DiskBatchStore(tmp_path / "b")
    try:
        with pytest.raises(StoreLocked):
            DiskBatchStore(tmp_path / "b")
    finally:
        await store.close()


async def test_two_redis_replicas_split_the_lines(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    a = RedisBatchStore.from_url(redis_url, redis_prefix, tmp_path / "a")
    b = RedisBatchStore.from_url(redis_url, redis_prefix, tmp_path / "b")
    try:
        batch = await add_batch(a, await add_file(a, 40))
        got = await asyncio.gather(*(s.claim(batch.id, 3, 60) for _ in range(7) for s in (a, b)))
        flat = [i for part in got for i in part]
        assert sorted(flat) == list(range(40))  # every line once, none to both
    finally:
        await a.close()
        await b.close()


@pytest.mark.redis
async def test_what_redis_holds_damaged_costs_that_record_never_the_store(
    redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    """Another replica's version, a hand edit or a restore can leave anything under the prefix: a record
    that is not one reads as absent, a key of another type as empty (replaced by the next write), a count
    that is no number restarts; uploads, listings, claims and results go on."""
    store = RedisBatchStore.from_url(redis_url, redis_prefix, tmp_path / "scratch")
    client = store.client
    try:
        kept = await add_file(store, 3)
        batch = await add_batch(store, kept)
        broken = await add_file(store, 2)
        await client.set(store._k("file", broken.id), b'{"id": 5}')  # a record that is not one
        await client.set(store._k("seq"), b"not a number")
        await client.delete(store._k("tenant", "t1", "usage"))
        await client.rpush(store._k("tenant", "t1", "usage"), b"x")
        added = await add_file(store, 1, limits=(10, 100_000))  # the quota's key replaced, seq restarted
        assert [f.id for f in await store.list_files("k1")] == [added.id, kept.id]  # newest first still
        assert await store.get_file(broken.id) is None
        cursor, lease, _retry, res, counts = store._line_keys(batch.id)
        await client.set(cursor, b"nan")
        await client.sadd(lease, b"x")
        claimed = await store.claim(batch.id, 0, 30.0)  # (the lease key replaced)
        await client.zadd(lease, {b"[]": 0, b"99": 0, b"-1": 0})  # members that name no line of the batch
        await client.hset(counts, mapping={"ok": "text", "input": "1e400"})
        claimed = await store.claim(batch.id, 3, 30.0)
        assert sorted(claimed) == [0, 1, 2]
        assert await store.record(batch.id, [result(i) for i in claimed]) == [True, True, True]
        assert (await store.counts(batch.id)).completed == 3
        await client.hset(res, b"junk", b"not a result")
        await client.set(store._k("file", kept.id, "idx"), b"\x01\x02\x03")  # spans cut short
        await client.delete(store._k("file", kept.id, "data"))
        await client.sadd(store._k("file", kept.id, "data"), b"x")
        assert await store.content_bytes(kept.id) == 0  # the download route then answers 404, not a cut body
        assert await store.read_lines(kept.id, [0, 1]) == [b"", b""]  # the lines fail, the runner goes on
        assert [r.index for r in [r async for r in store.results(batch.id)]] == [0, 1, 2]
        await client.set(store._k("batch", batch.id), b'{"id": "batch_x", "total": 10000000000000}')
        assert await store.get_batch(batch.id) is None and await store.list_batches("k1") == []
        assert await store.update_batch(batch.id, {"in_progress"}, status="finalizing") is None
        await client.delete(store._k("owner", "k1", "files"))
        await client.set(store._k("owner", "k1", "files"), b"x")
        assert await store.list_files("k1") == []
    finally:
        await store.close()

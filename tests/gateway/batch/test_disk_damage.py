"""The embedded batch store's files read back damaged (bench/chaos/disk_fuzz.py): a record that is not
one (of another shape, fields of the wrong type, bytes that are not UTF-8, too long to be one, a
directory in its place), or a file whose bytes or line index are not what its record says, is set
aside as `<name>.corrupt-<n>` with one warning and no traceback; every other record loads; a result log
with garbage, or with a line of many MiB, is read a head at a time; lines whose stored bytes are gone
are `line_unreadable`, never a failed tick."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from gateway.batch.disk import DiskBatchStore
from tests.gateway.batch.test_store import add_batch, add_file, result


def _records(root: Path, folder: str) -> dict[str, Path]:
    return {p.stem: p for p in (root / folder).glob("*.json")}


@pytest.mark.parametrize(
    "damage",
    [
        b"\xff\xfe\xc3(",
        b"[1, 2]",
        b'{"id": 12}',
        b"",
        b"x" * (2 << 20),
    ],
    ids=["not-utf8", "another-shape", "wrong-types", "empty", "too-long"],
)
async def test_a_damaged_record_is_set_aside_and_the_others_load(
    tmp_path: Path, damage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "b"
    store = DiskBatchStore(root)
    kept, damaged = await add_file(store, 2), await add_file(store, 2)
    batch = await add_batch(store, kept, status="completed")
    await store.close()
    (root / "files" / f"{damaged.id}.json").write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="tokenway.batch.disk"):
        store = DiskBatchStore(root)
    try:
        assert await store.get_file(damaged.id) is None
        assert await store.get_file(kept.id) is not None
        assert await store.get_batch(batch.id) is not None
        assert sorted(p.name for p in (root / "files").glob(f"{damaged.id}.*")) == [
            f"{damaged.id}.idx.corrupt-1",
            f"{damaged.id}.json.corrupt-1",
            f"{damaged.id}.jsonl.corrupt-1",
        ]
        warnings = [r for r in caplog.records if damaged.id in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].exc_info is None  # one line, no traceback
    finally:
        await store.close()


async def test_a_field_of_the_wrong_type_in_a_batch_record_sets_it_aside(tmp_path: Path) -> None:
    root = tmp_path / "b"
    store = DiskBatchStore(root)
    file = await add_file(store, 2)
    kept, damaged = await add_batch(store, file, status="completed"), await add_batch(store, file)
    await store.close()
    path = root / "batches" / f"{damaged.id}.json"
    record = orjson.loads(path.read_bytes())
    path.write_bytes(orjson.dumps({**record, "total": "12"}))
    store = DiskBatchStore(root)
    try:
        assert await store.get_batch(damaged.id) is None
        assert await store.get_batch(kept.id) is not None
        assert (root / "batches" / f"{damaged.id}.json.corrupt-1").exists()
    finally:
        await store.close()


async def test_a_directory_in_a_records_place_is_set_aside(tmp_path: Path) -> None:
    root = tmp_path / "b"
    store = DiskBatchStore(root)
    file = await add_file(store, 2)
    batch = await add_batch(store, file)
    await store.close()
    path = root / "batches" / f"{batch.id}.json"
    path.unlink()
    path.mkdir()
    store = DiskBatchStore(root)
    try:
        assert await store.get_batch(batch.id) is None
        assert await store.get_file(file.id) is not None
    finally:
        await store.close()


@pytest.mark.parametrize("piece", [".jsonl", ".idx"])
async def test_a_file_whose_bytes_or_index_are_not_its_records_is_set_aside(tmp_path: Path, piece: str) -> None:
    root = tmp_path / "b"
    store = DiskBatchStore(root)
    file = await add_file(store, 3)
    await store.close()
    path = root / "files" / f"{file.id}{piece}"
    path.write_bytes(path.read_bytes()[:-5])
    store = DiskBatchStore(root)
    try:
        assert await store.get_file(file.id) is None
        assert (root / "files" / f"{file.id}.json.corrupt-1").exists()
    finally:
        await store.close()


async def test_lines_whose_stored_bytes_went_away_read_as_unreadable(tmp_path: Path) -> None:
    store = DiskBatchStore(tmp_path / "b")
    try:
        file = await add_file(store, 3)
        (tmp_path / "b" / "files" / f"{file.id}.jsonl").write_bytes(b"{}\n")  # shorter than its spans
        assert await store.read_lines(file.id, [0, 2]) == [b"", b""]
        (tmp_path / "b" / "files" / f"{file.id}.jsonl").unlink()
        assert await store.read_lines(file.id, [1]) == [b""]
    finally:
        await store.close()


async def batch_with_results(root: Path, lines: int, done: int) -> tuple[str, Path]:
    """A batch of `lines` lines whose first `done` finished, its store closed: (its id, its result log)."""
    store = DiskBatchStore(root)
    batch = await add_batch(store, await add_file(store, lines))
    await store.claim(batch.id, lines, 60)
    await store.record(batch.id, [result(i) for i in range(done)])
    await store.close()
    return batch.id, root / "batches" / f"{batch.id}.wal"


async def test_a_result_log_with_garbage_and_a_huge_line_keeps_its_results(tmp_path: Path) -> None:
    root = tmp_path / "b"
    batch_id, wal = await batch_with_results(root, 4, 2)
    records = wal.read_bytes()
    first = records.index(b"\n") + 1
    garbage = b'{"i": "x", "ok": 1, "u": []}\tline\n\xff\xfe\n' + b"y" * (3 << 20) + b"\n" + b'{"i": 2}\t\n'
    wal.write_bytes(records[:first] + garbage + records[first:])
    store = DiskBatchStore(root)
    try:
        assert (await store.counts(batch_id)).completed == 2
        assert sorted(await store.claim(batch_id, 4, 60)) == [2, 3]
        assert [r.index async for r in store.results(batch_id)] == [0, 1]
    finally:
        await store.close()


async def test_a_result_log_that_is_a_directory_is_set_aside_and_its_lines_run_again(tmp_path: Path) -> None:
    root = tmp_path / "b"
    batch_id, wal = await batch_with_results(root, 2, 1)
    wal.unlink()
    wal.mkdir()
    store = DiskBatchStore(root)
    try:
        assert sorted(await store.claim(batch_id, 2, 60)) == [0, 1]
        assert (root / "batches" / f"{batch_id}.wal.corrupt-1").is_dir()
        assert await store.record(batch_id, [result(0)]) == [True]
    finally:
        await store.close()

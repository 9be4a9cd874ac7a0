"""The batch runner over the disk store with a scripted walk: completion, deferrals, retries, back-off
while interactive requests wait, cancel, expiry, validation, and a restart in the middle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Fleet
from backends.types import EndpointState
from gateway.batch.capacity import BatchCapacity, BatchLoad
from gateway.batch.config import BatchSettings
from gateway.batch.disk import DiskBatchStore
from gateway.batch.lines import NO_SPARE_CAPACITY, LineAnswer, LineRequest
from gateway.batch.objects import BatchMeta, FileMeta, new_batch_id, new_file_id
from gateway.batch.routes import scan_file
from gateway.batch.runner import BatchRunner
from policies.holder import PolicyHolder
from policies.loader import parse_config
from policies.policy import Policy, hash_key
from policies.schema import PoliciesConfig

Script = Callable[[LineRequest], LineAnswer]
SETTINGS = BatchSettings.model_validate({"runner": {"tick_s": 0.02, "retry_min_s": 0.01, "retry_max_s": 0.05}})


def policy_holder(**extra: Any) -> PolicyHolder:
    doc = {
        "tenants": {"t": {}},
        "keys": [{"id": "k1", "tenant": "t", "sha256": hash_key("sk-1")}],
        "models": {"m": {}},
        **extra,
    }
    config: PoliciesConfig = parse_config(orjson.dumps(doc).decode())
    return PolicyHolder(Policy(config))


def fleet(endpoints: int = 2) -> Fleet:
    pool = PoolConfig(
        name="p", model="m", endpoints=[StaticEndpointConfig(url=f"http://e{i}") for i in range(endpoints)]
    )
    built = Fleet.from_configs([pool])
    for endpoint in built.endpoints():
        endpoint.state = EndpointState.READY
    return built


class Walk:
    """A stand-in for the request walk: places the line on an endpoint like the batch gate, then
    answers as `script` says after a short await."""

    def __init__(self, built: Fleet, load: BatchLoad, script: Script) -> None:
        self.endpoints = list(built.endpoints())
        self.load = load
        self.script = script
        self.calls: list[LineRequest] = []
        self.most_per_endpoint = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.hold: Callable[[LineRequest], bool] = lambda line: True  # lines that wait for the gate

    async def __call__(self, line: LineRequest) -> LineAnswer:
        self.calls.append(line)
        endpoint = min(self.endpoints, key=lambda e: self.load.running_on(e.id))
        self.load.placed(line.request_id, endpoint.id)
        self.most_per_endpoint = max(self.most_per_endpoint, self.load.running_on(endpoint.id))
        try:
            if self.hold(line):
                await self.gate.wait()
            await asyncio.sleep(0.001)
            return self.script(line)
        finally:
            self.load.left(line.request_id)


def ok(line: LineRequest) -> LineAnswer:
    body = {"object": "list", "data": [{"embedding": [0.1]}], "usage": {"prompt_tokens": 2, "total_tokens": 2}}
    return LineAnswer(200, orjson.dumps(body), {})


async def upload(store: DiskBatchStore, tmp_path: Path, n: int, model: str = "m") -> FileMeta:
    path = store.scratch() / f"u-{new_file_id()}"
    path.write_bytes(
        b"\n".join(
            orjson.dumps(
                {
                    "custom_id": f"c{i}",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {"model": model, "input": "x"},
                }
            )
            for i in range(n)
        )
    )
    scan, spans = scan_file(path, 1000)
    assert scan.ok
    now = int(time.time())
    meta = FileMeta(
        new_file_id(),
        "k1",
        "t",
        "in.jsonl",
        "batch",
        path.stat().st_size,
        now,
        now + 3600,
        scan.lines,
        scan.urls,
        scan.models,
    )
    await store.add_file(meta, path, spans, limits=(0, 0))
    return meta


async def create(store: DiskBatchStore, file: FileMeta, expires_in_s: float = 86400) -> BatchMeta:
    now = int(time.time())
    meta = BatchMeta(new_batch_id(), "k1", "t", "/v1/embeddings", file.id, now, int(now + expires_in_s), file.lines)
    await store.add_batch(meta)
    return meta


class Harness:
    def __init__(
        self,
        tmp_path: Path,
        script: Script = ok,
        settings: BatchSettings = SETTINGS,
        waiting: int = 0,
        *,
        store: DiskBatchStore | None = None,
        walk: type[Walk] = Walk,
    ):
        self.store = store or DiskBatchStore(tmp_path / "batch")
        self.fleet = fleet()
        self.waiting = waiting
        limits = settings.spare.limits(settings.runner.max_lines_per_endpoint)
        self.capacity = BatchCapacity(self.fleet, limits, waiting=lambda pool: self.waiting)
        self.walk = walk(self.fleet, self.capacity.load, script)
        self.runner = BatchRunner(self.store, settings, policy_holder(), self.capacity, self.walk)

    async def __aenter__(self) -> Harness:
        await self.runner.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.stop()
        await self.store.close()

    async def until(self, batch_id: str, *statuses: str, timeout_s: float = 30.0) -> BatchMeta:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            meta = await self.store.get_batch(batch_id)
            if meta is not None and meta.status in statuses:
                return meta
            await asyncio.sleep(0.01)
        raise AssertionError(f"batch {batch_id} never reached {statuses}: {await self.store.get_batch(batch_id)}")

    async def lines_of(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        data = b"".join([chunk async for chunk in self.store.content(file_id)])
        return [orjson.loads(row) for row in data.splitlines()]


async def test_a_batch_runs_to_completion_within_its_caps(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        batch = await create(h.store, await upload(h.store, tmp_path, 60))
        done = await h.until(batch.id, "completed")
        output = await h.lines_of(done.output_file_id)
        assert [row["custom_id"] for row in output] == [f"c{i}" for i in range(60)]  # in input order
        assert all(row["response"]["status_code"] == 200 and row["error"] is None for row in output)
        assert done.error_file_id is None
        assert done.in_progress_at is not None and done.finalizing_at is not None and done.completed_at is not None
        assert done.final_counts is not None and done.final_counts[:3] == [60, 0, 120]  # lines and input tokens
        assert len(h.walk.calls) == 60
        assert h.walk.most_per_endpoint <= SETTINGS.runner.max_lines_per_endpoint


async def test_not_now_answers_defer_and_failures_go_to_the_error_file(tmp_path: Path) -> None:
    seen: dict[str, int] = {}

    def script(line: LineRequest) -> LineAnswer:
        seen[line.custom_id] = seen.get(line.custom_id, 0) + 1
        if line.custom_id == "c0" and seen["c0"] < 3:  # rate limited twice, then served
            return LineAnswer(
                429, b'{"error":{"code":"rate_limit_exceeded"}}', {"retry-after-ms": "5"}, "rate_limit_exceeded"
            )
        if line.custom_id == "c1":
            return LineAnswer(
                502, b'{"error":{"message":"upstream failed","code":"upstream_error"}}', {}, "upstream_error"
            )
        if line.custom_id == "c2":
            return LineAnswer(
                400, b'{"error":{"message":"too long","code":"context_length_exceeded"}}', {}, "context_length_exceeded"
            )
        return ok(line)

    async with Harness(tmp_path, script) as h:
        batch = await create(h.store, await upload(h.store, tmp_path, 5))
        done = await h.until(batch.id, "completed")
        output = await h.lines_of(done.output_file_id)
        errors = await h.lines_of(done.error_file_id)
        assert [row["custom_id"] for row in output] == ["c0", "c3", "c4"]
        assert [(row["custom_id"], row["response"]["status_code"]) for row in errors] == [("c1", 502), ("c2", 400)]
        assert seen["c0"] == 3
        assert seen["c1"] == SETTINGS.runner.max_attempts  # a failing upstream is tried, then given up
        assert seen["c2"] == 1


async def test_no_line_starts_while_interactive_requests_wait(tmp_path: Path) -> None:
    async with Harness(tmp_path, waiting=1) as h:
        batch = await create(h.store, await upload(h.store, tmp_path, 4))
        await h.until(batch.id, "in_progress")
        for _ in range(20):
            await h.runner.tick()
        assert h.walk.calls == []
        h.waiting = 0
        await h.until(batch.id, "completed")


@pytest.mark.slow
async def test_a_model_backs_off_while_the_batch_gate_refuses_its_lines(tmp_path: Path) -> None:
    refusing = True

    def script(line: LineRequest) -> LineAnswer:
        if refusing:
            body = b'{"error":{"code":"batch_no_spare_capacity"}}'
            return LineAnswer(503, body, {"retry-after": "0"}, NO_SPARE_CAPACITY)
        return ok(line)

    runner = SETTINGS.runner.model_copy(update={"retry_min_s": 2.0, "retry_max_s": 30.0})
    settings = SETTINGS.model_copy(update={"runner": runner})
    async with Harness(tmp_path, script, settings=settings) as h:
        batch = await create(h.store, await upload(h.store, tmp_path, 60))
        await eventually(lambda: asyncio.sleep(0, len(h.walk.calls)), lambda n: n > 0)
        await eventually(lambda: h.store.held(batch.id), lambda n: n == 0)  # the first round was refused
        first_round = len(h.walk.calls)
        for _ in range(20):
            await h.runner.tick()
        assert first_round <= 2 * runner.max_lines_per_endpoint  # what the free slots took at once
        assert len(h.walk.calls) == first_round  # and nothing more while the model backs off
        refusing = False
        done = await h.until(batch.id, "completed")  # a probe finds room, then the rest follow
        assert done.final_counts is not None and done.final_counts[0] == 60


async def test_cancel_stops_the_lines_and_lists_the_unrun_ones(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        h.walk.gate.clear()  # lines start and hang
        batch = await create(h.store, await upload(h.store, tmp_path, 40))
        await h.until(batch.id, "in_progress")
        await eventually(lambda: asyncio.sleep(0, len(h.walk.calls)), lambda n: n >= 5)
        await h.store.update_batch(batch.id, {"in_progress"}, status="cancelling", cancelling_at=int(time.time()))
        h.runner.wake()
        done = await h.until(batch.id, "cancelled")
        assert done.output_file_id is None
        errors = await h.lines_of(done.error_file_id)
        assert len(errors) == 40 and {row["error"]["code"] for row in errors} == {"batch_cancelled"}
        assert h.runner.lines_in_flight == 0
        assert h.capacity.load.lines == 0


async def test_a_line_cancelled_before_its_first_step_gives_its_claim_back(tmp_path: Path) -> None:
    h = Harness(tmp_path)  # the runner is not started: the test drives its ticks
    batch = await create(h.store, await upload(h.store, tmp_path, 3))
    await h.runner.tick()  # validates, claims and launches: the line tasks have not run a step yet
    tasks = [task for lines in h.runner._tasks.values() for task in lines.values()]
    assert tasks and await h.store.held(batch.id) == len(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await eventually(lambda: h.store.held(batch.id), lambda n: n == 0)
    assert h.walk.calls == [] and h.runner.lines_in_flight == 0 and h.capacity.load.lines == 0
    await h.runner.start()
    try:
        done = await h.until(batch.id, "completed")
        assert done.final_counts is not None and done.final_counts[0] == 3
    finally:
        await h.runner.stop()
        await h.store.close()


class StoreDroppingOneCancel(DiskBatchStore):
    """The disk store with one fault: its first `active_batches` waits until it is cancelled, then
    drops the cancel and answers. redis-py does this on Python 3.11 (each socket write runs under
    `asyncio.wait_for`, which returns the result when a cancel lands as the write completes): a
    runner's tick then goes on after `stop` cancelled it."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.waiting = asyncio.Event()
        self.dropped = 0

    async def active_batches(self) -> list[str]:
        found = await super().active_batches()
        if not self.waiting.is_set():
            self.waiting.set()
            try:
                await asyncio.Event().wait()  # until cancelled
            except asyncio.CancelledError:
                self.dropped += 1
        return found


class WalkDroppingOneCancel(Walk):
    """A walk whose line, cancelled while it waits, drops that cancel and waits again (an HTTP
    client that swallows a cancel the way `asyncio.wait_for` does on Python 3.11)."""

    dropped = 0

    async def __call__(self, line: LineRequest) -> LineAnswer:
        try:
            return await super().__call__(line)
        except asyncio.CancelledError:
            self.dropped += 1
            return await super().__call__(line)


async def test_stop_ends_the_runner_when_a_store_call_drops_its_cancel(tmp_path: Path) -> None:
    store = StoreDroppingOneCancel(tmp_path / "batch")
    h = Harness(tmp_path, store=store)
    await h.runner.start()
    try:
        # a ceiling, checked after: its cancel reaches the runner's task through `stop`'s await too
        async with asyncio.timeout(30) as ceiling:
            await store.waiting.wait()
            await h.runner.stop()
        assert not ceiling.expired() and store.dropped == 1
    finally:
        await store.close()


async def test_stop_ends_lines_that_drop_their_cancel_and_gives_their_claims_back(tmp_path: Path) -> None:
    h = Harness(tmp_path, walk=WalkDroppingOneCancel)
    h.walk.gate.clear()  # lines start and wait
    await h.runner.start()
    try:
        batch = await create(h.store, await upload(h.store, tmp_path, 4))
        await eventually(lambda: asyncio.sleep(0, len(h.walk.calls)), lambda n: n >= 4)
        async with asyncio.timeout(30) as ceiling:
            await h.runner.stop()
        assert not ceiling.expired()
        assert isinstance(h.walk, WalkDroppingOneCancel) and h.walk.dropped == 4
        assert h.runner.lines_in_flight == 0 and h.capacity.load.lines == 0
        assert await h.store.held(batch.id) == 0  # claimed again after a restart, not held by a dead lease
    finally:
        await h.store.close()


async def test_an_expired_batch_keeps_what_ran(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        batch = await create(h.store, await upload(h.store, tmp_path, 3), expires_in_s=-1)
        done = await h.until(batch.id, "expired")
        assert done.expired_at is not None
        errors = await h.lines_of(done.error_file_id)
        assert [row["error"]["code"] for row in errors] == ["batch_expired"] * 3


async def test_validation_names_the_lines_at_fault(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        file = await upload(h.store, tmp_path, 2, model="unknown-model")
        batch = await create(h.store, file)
        failed = await h.until(batch.id, "failed")
        assert failed.errors == [
            {
                "code": "model_not_found",
                "line": 1,
                "message": "The model 'unknown-model' does not exist or is not served here.",
                "param": "body.model",
            }
        ]
        assert h.walk.calls == []


async def test_a_restart_mid_batch_runs_every_line_once_in_the_output(tmp_path: Path) -> None:
    first = Harness(tmp_path)
    first.walk.gate.clear()
    first.walk.hold = lambda line: line.index >= 10  # lines from the 11th hang: in flight when the process "dies"
    await first.runner.start()
    batch = await create(first.store, await upload(first.store, tmp_path, 30))

    async def recorded() -> int:
        return (await first.store.counts(batch.id)).recorded

    async def hanging() -> set[int]:
        return {c.index for c in first.walk.calls} - {r.index async for r in first.store.results(batch.id)}

    await eventually(recorded, lambda n: n >= 10)
    await eventually(hanging, lambda lines: len(lines) >= 3)
    done_before = {r.index async for r in first.store.results(batch.id)}
    in_flight = {c.index for c in first.walk.calls} - done_before
    await first.runner.stop()
    await first.store.close()
    async with Harness(tmp_path) as second:
        done = await second.until(batch.id, "completed")
        output = await second.lines_of(done.output_file_id)
        assert [row["custom_id"] for row in output] == [f"c{i}" for i in range(30)]  # each once, none lost
        ran_again = {c.index for c in second.walk.calls}
        assert not ran_again & done_before  # a recorded line never runs again
        assert in_flight <= ran_again  # a line in flight at the crash, never recorded, does


async def eventually(read: Callable[[], Any], ok: Callable[[Any], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ok(await read()):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition never held")


@pytest.mark.parametrize("limit", [1, 3])
async def test_the_process_wide_cap_holds(tmp_path: Path, limit: int) -> None:
    settings = SETTINGS.model_copy(update={"runner": SETTINGS.runner.model_copy(update={"max_lines_in_flight": limit})})
    async with Harness(tmp_path, settings=settings) as h:
        most = 0

        def watch() -> None:
            nonlocal most
            most = max(most, h.runner.lines_in_flight)

        batch = await create(h.store, await upload(h.store, tmp_path, 12))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            watch()
            meta = await h.store.get_batch(batch.id)
            if meta is not None and meta.status == "completed":
                break
            await asyncio.sleep(0.001)
        assert most <= limit


async def test_a_line_whose_stored_bytes_are_not_a_request_fails_alone(tmp_path: Path) -> None:
    """The store holds what was validated at upload, unless something else wrote over it (a shared store
    is input): such a line goes to the error file as `line_unreadable`, and the others run."""
    async with Harness(tmp_path) as h:
        file = await upload(h.store, tmp_path, 3)
        path = h.store._file_path(file.id, ".jsonl")
        data = bytearray(path.read_bytes())
        first_end = data.index(b"\n")
        data[:first_end] = b"1.5" + b" " * (first_end - 3)  # line 0 is now a number, its span unchanged
        path.write_bytes(bytes(data))
        batch = await create(h.store, file)
        done = await h.until(batch.id, "completed")
        errors = await h.lines_of(done.error_file_id)
        assert [row["error"]["code"] for row in errors] == ["line_unreadable"]
        assert [row["custom_id"] for row in await h.lines_of(done.output_file_id)] == ["c1", "c2"]

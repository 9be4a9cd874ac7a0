"""The batch runner: a background task of each gateway process that moves batches along.

Each tick (`runner.tick_s`, or at once when a line ends or a batch arrives) it walks the batches
that are not finished:

- validating → in_progress, or failed with the lines at fault (a url other than the batch's
  endpoint, a model that is not served or not allowed for the key);
- in_progress: while the pools of its models have spare capacity (`BatchCapacity`: nobody waits
  for them, their engines neither queue nor run short of KV, few batch lines run there), claim
  lines and run each through the request walk (`RunLine`); when every line is recorded,
  finalizing → completed; past `expires_at`, expired;
- cancelling: its lines still running here are stopped, and once no replica holds any, cancelled.

The batches share the free capacity in turn (round robin, rotating which goes first). A line's
answer is recorded (durably, before it counts) or the line goes back to be claimed later: rate
limited, over budget, no spare capacity, a 503 — "not now" is never a failure. A janitor drops
expired files and finished batches past their retention.

When the walk's batch gate finds no spare capacity for a model (its check at routing sees what the
runner's cannot: the line's own predicted latency), the model backs off: no line of it is taken
for `retry_min_s`, doubling at each refusal up to `retry_max_s`, and then a single line probes.
Without it every free slot would send a line through the whole walk to be refused, again and again,
and that walk costs the interactive requests' gateway its CPU.

When its store fails (Redis down), a tick fails: the first failure of an outage is logged with its
traceback, the next ones only counted (a warning with the count at most every
`_OUTAGE_SUMMARY_S`, one line when it recovers), and the ticks back off, doubling from `tick_s`
to `retry_max_s`, instead of logging a traceback every `tick_s`.

`stop` does not trust one cancel to end a task: on Python 3.11, `asyncio.wait_for` returns the
result instead of raising when a cancel lands in the step where the awaited operation completes,
and redis-py wraps each socket write in it (`socket_timeout`), so a cancel that meets a Redis
command as it finishes is dropped and the task runs on. The tick loop also checks a stop flag,
and tasks still running after a cancel are cancelled again until they end.

## Who a batch runs as (`owner_principal`)

Who a batch runs as: the principal of the key that created it, found the way the request path
finds a caller — the policy file's keys first, then the key directory (keys made through
`POST /admin/keys` or `tokenway keys create`, in SQLite or Redis).

A batch keeps only its creator's key id (never the secret), so the runner cannot re-authenticate
the way a request does; it looks the id up instead. Looking only in the policy file made every
batch of an API-made key fail with "The API key that created this batch is no longer valid". A key
that is disabled, revoked, expired or whose tenant is gone has no principal: its batch fails (or its
remaining lines do), as a request with it would be refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import orjson

from backends.tasks import cancel_and_wait
from gateway.batch.capacity import BatchCapacity
from gateway.batch.config import BatchSettings
from gateway.batch.finalize import write_outputs
from gateway.batch.lines import NO_SPARE_CAPACITY, LineAnswer, LineRequest, RunLine, classify, retry_after_s
from gateway.batch.objects import BatchMeta
from gateway.batch.store import BatchStore, LineResult, answered, unanswered
from policies.holder import PolicyHolder
from policies.policy import Policy
from policies.types import Principal


def owner_principal(policy: Policy, key_id: str) -> Principal | None:
    """The principal of the key `key_id` as the request path would see it now, or None."""
    principal = policy.principal_of(key_id)
    if principal is not None:
        return principal
    directory = policy.directory
    record = directory.keys.get(key_id) if directory is not None else None
    if directory is None or record is None or record.revoked_at_unix_s is not None:
        return None
    # The directory's own authentication of the key's current digest: its expiry check and its
    # cached principal, compiled against this policy exactly as for a request.
    return directory.authenticate(bytes.fromhex(record.sha256), record.sha256, policy)


log = logging.getLogger("tokenway.batch")

_JANITOR_EVERY_S: Final = 60.0
_OUTAGE_SUMMARY_S: Final = 60.0
_FINALIZE_LOCK_S: Final = 600.0


def _stored_line(raw: bytes) -> dict[str, Any] | None:
    """A line as it was validated at upload, or None when the store holds something else (a shared store
    is input: another version, a hand edit or a restore can leave anything there)."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(line, dict) or not isinstance(line.get("body"), dict) or "custom_id" not in line:
        return None
    return line


class BatchObserver(Protocol):
    """Metrics of the runner (`gateway.batch.metrics.BatchMetrics`)."""

    def line(self, outcome: str) -> None: ...

    def deferred(self, reason: str) -> None: ...


class _NoObserver:
    def line(self, outcome: str) -> None:
        return None

    def deferred(self, reason: str) -> None:
        return None


class Outage:
    """One failure log per outage: the first failure with its traceback, then a count (a warning
    at most every `summary_s`), and one line when things work again."""

    def __init__(self, what: str, summary_s: float = _OUTAGE_SUMMARY_S) -> None:
        self.what = what
        self.summary_s = summary_s
        self.failures = 0  # in a row
        self._since_s = 0.0
        self._reported_s = 0.0
        self._reported = 0  # failures counted in the last summary

    def failed(self, error: BaseException) -> None:
        now = time.monotonic()
        self.failures += 1
        if self.failures == 1:
            self._since_s = self._reported_s = now
            self._reported = 1
            log.error("%s failed (further failures are counted, not logged): %s", self.what, error, exc_info=error)
        elif now - self._reported_s >= self.summary_s:
            log.warning(
                "%s still failing: %d failures in %.0f s (%d since the last report; last: %s: %s)",
                self.what,
                self.failures,
                now - self._since_s,
                self.failures - self._reported,
                type(error).__name__,
                error,
            )
            self._reported_s = now
            self._reported = self.failures

    def ok(self) -> None:
        if self.failures:
            log.warning(
                "%s works again after %d failures in %.0f s", self.what, self.failures, time.monotonic() - self._since_s
            )
            self.failures = 0

    def backoff_s(self, base_s: float, most_s: float) -> float:
        """The wait before the next try: `base_s` while things work, doubling per failure up to `most_s`."""
        if not self.failures:
            return base_s
        return min(base_s * 2.0 ** min(self.failures, 30), max(most_s, base_s))


@dataclass(slots=True)
class _Cold:
    until_s: float  # no line of the model is taken before (monotonic)
    refusals: int  # in a row
    probe: str | None = None  # the request id of the line trying again


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        settings: BatchSettings,
        policies: PolicyHolder,
        capacity: BatchCapacity,
        run_line: RunLine,
        *,
        observer: BatchObserver | None = None,
        clock: Callable[[], float] = time.time,
        usage_committed: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self._usage_committed = usage_committed
        self.store = store
        self.settings = settings
        self.policies = policies
        self.capacity = capacity
        self.run_line = run_line
        self.observer: BatchObserver = observer or _NoObserver()
        self.clock = clock
        self._tasks: dict[str, dict[int, asyncio.Task[None]]] = {}  # batch -> line -> its task
        self._background: set[asyncio.Task[None]] = set()  # claims given back by `_never_ran`
        self._cold: dict[str, _Cold] = {}  # model -> its back-off, while the batch gate refuses its lines
        self._attempts: dict[tuple[str, int], int] = {}  # upstream failures of lines not recorded yet
        self._models: dict[str, list[str]] = {}  # batch -> the models its lines use (resolved)
        self._wake = asyncio.Event()
        self._main: asyncio.Task[None] | None = None
        self._stopping = False
        self._turn = 0
        self._renewed_s = 0.0
        self._janitor_s = 0.0
        self.outage = Outage("batch runner tick")
        self._record_outage = Outage("recording batch lines")
        self.statuses: dict[str, int] = {}  # unfinished batches by status, as of the last tick

    # --- life ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._stopping = False
        self._main = asyncio.get_running_loop().create_task(self._run(), name="batch-runner")

    async def stop(self) -> None:
        """Stop taking lines and stop the running ones (their lines are claimed again later, here
        after a restart or at once by another replica)."""
        self._stopping = True
        self._wake.set()
        if self._main is not None:
            await cancel_and_wait([self._main], what="batch runner")
        await cancel_and_wait([task for lines in self._tasks.values() for task in lines.values()], what="batch line")
        await asyncio.gather(*self._background, return_exceptions=True)

    def wake(self) -> None:
        self._wake.set()

    @property
    def lines_in_flight(self) -> int:
        return sum(len(lines) for lines in self._tasks.values())

    async def _run(self) -> None:
        runner = self.settings.runner
        while not self._stopping:  # a cancel from `stop` may be dropped (see the module's docstring)
            self._wake.clear()
            try:
                await self.tick()
                if time.monotonic() >= self._janitor_s:
                    self._janitor_s = time.monotonic() + _JANITOR_EVERY_S
                    await self.janitor()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.outage.failed(exc)
                if self._stopping:
                    return
                # backing off: a wake-up (a line ending, a new batch) does not cut the wait short
                await asyncio.sleep(self.outage.backoff_s(runner.tick_s, runner.retry_max_s))
                continue
            self.outage.ok()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that lands
            # as the wait ends, and `stop` would then wait for this loop forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(runner.tick_s):
                    await self._wake.wait()

    # --- one tick -----------------------------------------------------------------------------------
    async def tick(self) -> None:
        now = self.clock()
        runnable: list[BatchMeta] = []
        statuses: dict[str, int] = {}
        for batch_id in await self.store.active_batches():
            meta = await self.store.get_batch(batch_id)
            if meta is None:
                continue
            statuses[meta.status] = statuses.get(meta.status, 0) + 1
            if meta.status == "validating":
                meta = await self._validate(meta)
                if meta is None or meta.status != "in_progress":
                    continue
            if meta.status == "in_progress":
                if now >= meta.expires_at:
                    await self._end(meta, "expired")
                elif (await self.store.counts(meta.id)).recorded >= meta.total:
                    await self._finalize(meta, "completed")
                else:
                    runnable.append(meta)
            elif meta.status == "cancelling":
                await self._end(meta, "cancelled")
            elif meta.status == "finalizing":
                await self._finalize(meta, "completed")
        self.statuses = statuses
        await self._renew()
        await self._schedule(runnable)

    async def _validate(self, meta: BatchMeta) -> BatchMeta | None:
        """The input file against the batch: its urls, and its models for the key that made it."""
        policy = self.policies.current
        fleet = self.capacity.fleet
        errors: list[dict[str, Any]] = []
        models: list[str] = []
        file = await self.store.get_file(meta.input_file_id)
        principal = owner_principal(policy, meta.owner)
        if file is None:
            errors.append(
                _error("file_not_found", None, f"The input file {meta.input_file_id} no longer exists.", None)
            )
        elif principal is None:
            errors.append(
                _error("invalid_api_key", None, "The API key that created this batch is no longer valid.", None)
            )
        else:
            for url, line in sorted(file.urls.items(), key=lambda item: item[1]):
                if url != meta.endpoint:
                    message = f"The url {url!r} does not match the batch's endpoint {meta.endpoint!r}."
                    errors.append(_error("invalid_url", line, message, "url"))
            for name, line in sorted(file.models.items(), key=lambda item: item[1]):
                model = policy.resolve_model(name)
                if not fleet.pools_for_model(model):
                    message = f"The model '{name}' does not exist or is not served here."
                    errors.append(_error("model_not_found", line, message, "body.model"))
                elif not (principal.may_use(model) or principal.may_use(name)):
                    errors.append(
                        _error("model_not_allowed", line, f"This key may not use the model '{name}'.", "body.model")
                    )
                elif model not in models:
                    models.append(model)
        now = int(self.clock())
        if errors:
            return await self.store.update_batch(meta.id, {"validating"}, status="failed", failed_at=now, errors=errors)
        assert file is not None
        self._models[meta.id] = models
        single = next(iter(file.models)) if len(file.models) == 1 else None
        return await self.store.update_batch(
            meta.id, {"validating"}, status="in_progress", in_progress_at=now, model=single
        )

    def _models_of(self, meta: BatchMeta, models: dict[str, int]) -> list[str]:
        found = self._models.get(meta.id)
        if found is None:
            policy = self.policies.current
            found = self._models[meta.id] = list(dict.fromkeys(policy.resolve_model(m) for m in models))
        return found

    async def _schedule(self, batches: list[BatchMeta]) -> None:
        free = self.settings.runner.max_lines_in_flight - self.lines_in_flight
        if free <= 0 or not batches or self._stopping:
            return
        self._turn = (self._turn + 1) % len(batches)
        ordered = batches[self._turn :] + batches[: self._turn]
        for position, meta in enumerate(ordered):
            if free <= 0:
                return
            file = await self.store.get_file(meta.input_file_id)
            if file is None:
                continue
            models = self._models_of(meta, file.models)
            now = time.monotonic()
            warm = [model for model in models if self._warm(model, now)]
            if not warm:
                self.observer.deferred("backing_off")
                continue
            spare = sum(self.capacity.model_slots(model) for model in warm)
            if spare <= 0:
                self.observer.deferred("no_spare_capacity")
                continue
            share = math.ceil(min(spare, free) / (len(ordered) - position))
            if any(model in self._cold for model in warm):
                share = 1  # after a refusal, one line probes before the rest follow
            indices = await self.store.claim(meta.id, share, self.settings.runner.lease_s)
            if not indices:
                continue
            free -= len(indices)
            principal = owner_principal(self.policies.current, meta.owner)
            raws = await self.store.read_lines(meta.input_file_id, indices)
            for index, raw in zip(indices, raws, strict=True):
                line = _stored_line(raw)
                if line is None:  # the store no longer holds the request uploaded (a damaged shared store)
                    message = "the line's stored bytes are not the request uploaded; upload the file again"
                    await self._record(meta, unanswered(index, "", "line_unreadable", message), "error")
                    continue
                self._launch(meta, index, line, principal)

    def _launch(self, meta: BatchMeta, index: int, line: dict[str, Any], principal: Principal | None) -> None:
        body: dict[str, Any] = line["body"]
        model = self.policies.current.resolve_model(str(body.get("model")))
        request_id = f"{meta.id}-{index}-{os.urandom(4).hex()}"
        self.capacity.load.started(request_id, model)
        cold = self._cold.get(model)
        if cold is not None and cold.probe is None:
            cold.probe = request_id
        task = asyncio.get_running_loop().create_task(
            self._line(meta, index, str(line["custom_id"]), body, principal, request_id, model)
        )
        self._tasks.setdefault(meta.id, {})[index] = task
        task.add_done_callback(lambda done: self._never_ran(meta.id, index, request_id, done))

    def _warm(self, model: str, now: float) -> bool:
        """May lines of `model` be taken: no back-off, or its time is up and no probe is out (a
        probe that got an endpoint ends the back-off at once, before its answer)."""
        cold = self._cold.get(model)
        if cold is None:
            return True
        if cold.probe is not None:
            load = self.capacity.load
            if load.routed(cold.probe):
                del self._cold[model]
                return True
            if load.is_batch(cold.probe):
                return False  # still on its way
            cold.probe = None  # it ended unrouted without an answer (cancelled): another one may go
        return cold.until_s <= now

    def _spare_seen(self, model: str, found: bool) -> None:
        """The batch gate placed a line of `model` (`found`) or refused it: clear or extend its back-off.
        Refusals of lines taken before the back-off began do not extend it."""
        if found:
            self._cold.pop(model, None)
            return
        now = time.monotonic()
        cold = self._cold.get(model)
        if cold is not None and cold.until_s > now:
            return
        refusals = cold.refusals if cold is not None else 0
        runner = self.settings.runner
        self._cold[model] = _Cold(now + min(runner.retry_min_s * 2**refusals, runner.retry_max_s), refusals + 1)

    def _never_ran(self, batch_id: str, index: int, request_id: str, task: asyncio.Task[None]) -> None:
        """A task cancelled before its first step never enters `_line` (nor its `finally`): its
        claim goes back and its slot is freed here, or the batch would wait for it for ever."""
        lines = self._tasks.get(batch_id)
        if lines is None or lines.get(index) is not task:
            return  # `_line` ran and cleaned up
        del lines[index]
        if not lines:
            del self._tasks[batch_id]
        self.capacity.load.finished(request_id)
        self._give_back_in_background(batch_id, index)
        self.wake()

    def _give_back_in_background(self, batch_id: str, index: int) -> asyncio.Task[None]:
        """A claim given back by a task of its own, which `stop` waits for: the line's task may
        be cancelled again while it waits (see `backends.tasks.cancel_and_wait`), the giving back goes on."""
        giving = asyncio.get_running_loop().create_task(self._give_back(batch_id, index))
        self._background.add(giving)
        giving.add_done_callback(self._background.discard)
        return giving

    # --- one line -----------------------------------------------------------------------------------
    async def _line(
        self,
        meta: BatchMeta,
        index: int,
        custom_id: str,
        body: dict[str, Any],
        principal: Principal | None,
        request_id: str,
        model: str,
    ) -> None:
        key = (meta.id, index)
        try:
            if principal is None:
                result = unanswered(
                    index, custom_id, "invalid_api_key", "The API key that created this batch is no longer valid."
                )
                await self._record(meta, result, "error")
                return
            request = LineRequest(meta.id, index, custom_id, meta.api, body, principal, request_id)
            try:
                answer = await self.run_line(request)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch %s line %d failed in the gateway", meta.id, index)
                answer = LineAnswer(
                    500, b'{"error":{"message":"internal error","type":"server_error"}}', {}, "internal_error"
                )
            self._spare_seen(model, answer.code != NO_SPARE_CAPACITY)
            verdict = classify(answer)
            if verdict == "later":
                await self._defer(meta, index, answer, answer.code or f"http_{answer.status}")
                return
            if verdict == "retry":
                attempts = self._attempts[key] = self._attempts.get(key, 0) + 1
                if attempts < self.settings.runner.max_attempts:
                    await self._defer(meta, index, answer, "upstream_error", backoff=attempts)
                    return
            result = answered(index, custom_id, answer.status, request_id, answer.body)
            await self._record(meta, result, "ok" if result.ok else "error")
        except asyncio.CancelledError:
            await asyncio.shield(self._give_back_in_background(meta.id, index))
            raise
        except Exception as exc:  # the store failed (Redis down): logged once per outage
            self._record_outage.failed(exc)
            await self._give_back(meta.id, index, self.settings.runner.retry_max_s)
        finally:
            self.capacity.load.finished(request_id)
            lines = self._tasks.get(meta.id)
            if lines is not None:
                lines.pop(index, None)
                if not lines:
                    del self._tasks[meta.id]
            self.wake()

    async def _record(self, meta: BatchMeta, result: LineResult, outcome: str) -> None:
        # The line's usage record reaches the ledger file before its result counts as done: a
        # kill -9 in between would keep the answer (never re-run) and lose its only record.
        if self._usage_committed is not None:
            await self._usage_committed()
        recorded = await self.store.record(meta.id, [result])
        self._record_outage.ok()
        self._attempts.pop((meta.id, result.index), None)
        self.observer.line(outcome if recorded[0] else "duplicate")

    async def _defer(self, meta: BatchMeta, index: int, answer: LineAnswer, reason: str, backoff: int = 0) -> None:
        runner = self.settings.runner
        delay = retry_after_s(answer) or runner.retry_min_s * (2**backoff)
        await self.store.defer(meta.id, [index], min(max(delay, runner.retry_min_s), runner.retry_max_s))
        self.observer.deferred(reason)

    async def _give_back(self, batch_id: str, index: int, delay_s: float = 0.0) -> None:
        with contextlib.suppress(Exception):
            await self.store.defer(batch_id, [index], delay_s)

    async def _renew(self) -> None:
        """Keep this replica's claims alive while their lines run (Redis; a no-op on disk)."""
        lease_s = self.settings.runner.lease_s
        if time.monotonic() - self._renewed_s < lease_s / 3:
            return
        self._renewed_s = time.monotonic()
        for batch_id, lines in list(self._tasks.items()):
            await self.store.renew(batch_id, list(lines), lease_s)

    # --- the end of a batch -------------------------------------------------------------------------
    async def _end(self, meta: BatchMeta, ending: str) -> None:
        """Stop the batch's lines here; finalize once no replica holds any."""
        for task in list(self._tasks.get(meta.id, {}).values()):
            task.cancel()
        if await self.store.held(meta.id) > 0:
            return
        await self._finalize(meta, ending)

    async def _finalize(self, meta: BatchMeta, ending: str) -> None:
        name = f"finalize:{meta.id}"
        if not await self.store.lock(name, _FINALIZE_LOCK_S):
            return  # another replica is at it
        try:
            now = int(self.clock())
            if ending == "completed" and meta.status == "in_progress":
                moved = await self.store.update_batch(meta.id, {"in_progress"}, status="finalizing", finalizing_at=now)
                if moved is None:
                    return
                meta = moved
            ttl_s = meta.output_ttl_s or self.settings.file_ttl_s
            output_id, error_id = await write_outputs(self.store, meta, ending, ttl_s)
            counts = await self.store.counts(meta.id)
            stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[ending]
            done = await self.store.update_batch(
                meta.id,
                {"in_progress", "finalizing", "cancelling"},
                status=ending,
                output_file_id=output_id,
                error_file_id=error_id,
                final_counts=counts.as_list(),
                **{stamp: int(self.clock())},
            )
            if done is not None:
                await self.store.drop_progress(meta.id)
                self._forget(meta.id)
                log.info("batch %s %s", meta.id, ending)
        finally:
            await self.store.unlock(name)

    def _forget(self, batch_id: str) -> None:
        self._models.pop(batch_id, None)
        for key in [k for k in self._attempts if k[0] == batch_id]:
            del self._attempts[key]

    # --- retention ----------------------------------------------------------------------------------
    async def janitor(self) -> None:
        """Drop files past their expiry (unless an unfinished batch reads them) and finished batches
        past `batch_ttl_s`."""
        now = self.clock()
        in_use = set()
        for batch_id in await self.store.active_batches():
            meta = await self.store.get_batch(batch_id)
            if meta is not None:
                in_use.add(meta.input_file_id)
        for file_id in await self.store.expired_files(now):
            if file_id not in in_use:
                await self.store.delete_file(file_id)
        for batch_id in await self.store.expired_batches(now - self.settings.batch_ttl_s):
            await self.store.delete_batch(batch_id)


def _error(code: str, line: int | None, message: str, param: str | None) -> dict[str, Any]:
    return {"code": code, "line": line, "message": message, "param": param}

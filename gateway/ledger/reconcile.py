"""Spend reconciliation: what the budgets enforced against what the ledger recorded, per key.

Two books count a key's dollars: the admission store's spend counters (a key budget's, else the
shadow `@spend` day and month counters: `policies/limits/plan.py`), which decide the 429s, and the
usage ledger, which operators bill from. They are charged the same figure (`price_usd` at settlement),
so for each key and budget period `enforced - open reservations - recorded` is zero; anything else
is a bug or a loss (a counter charged twice, a record the ledger dropped, a settlement that never
arrived, a reload that re-priced a request in flight). A LiteLLM key's enforced counter stood at
twice its spend log, refusing at 74 % of the budget, until a user did the sums by hand
(BerriAI/litellm#36926); this module does them, periodically.

- `SpendTally` (`writer.py`) is told of every record the ledger accepted (`LedgerWriter.tally`) and sums its cost
  per (period, period id, key), bounded: at most `max_keys` keys per period, the rest in one
  overflow sum. Only the current and the previous period of each kind are kept.
- `Admission.open_usd` is what the keys' reservations in flight on this replica hold.
- `SpendReconciler.tick` reads the enforced counters with the store's `peek` (memory, or Redis
  across replicas), subtracts open reservations and compares. With Redis every replica's recorded
  sums and open reservations are shared under the limiter's key prefix (`HINCRBYFLOAT` into one hash
  per period; one short-lived hash of open reservations per replica), so each replica compares the
  cluster's counters with the cluster's ledger. A replica's own records reach Redis at its next tick,
  so a difference that lasts less than an interval or two is in-flight, not drift: the alert waits
  (`deploy/prometheus/alerts.yml`).

Exported as `tokenway_spend_drift_usd{period}` (sum of |drift| over the keys compared),
`tokenway_spend_drift_ratio{period}` (that over the recorded spend) and
`tokenway_spend_drift_keys{period}` (keys past the tolerance); `/admin/status` lists the worst keys.

What it cannot see: a key with no ledger record in the period (nothing names it to compare); a key
whose only key-scope budget matches one model (that counter counts one model's spend, the ledger
all of them); a key budget added mid-period (its counter starts at zero, the ledger's sum does not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from aiohttp import web
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from backends.tasks import cancel_and_wait
from gateway.app import keys as appkeys
from gateway.ledger.writer import PERIODS, SpendTally
from policies.limits.memory_store import period_id, period_ttl_s
from policies.limits.plan import Outcome, Plan
from policies.limits.scriptpipe import stored_number
from policies.policy import Policy
from policies.types import Principal

log = logging.getLogger("tokenway.reconcile")

MAX_LISTED: Final = 20  # keys past the tolerance listed on /admin/status, worst first
OVERFLOW: Final = "(other keys)"


class Peekable(Protocol):
    async def peek(self, plan: Plan, now_s: float | None = None) -> Outcome: ...


class AdmissionView(Protocol):
    @property
    def store(self) -> Any: ...

    @property
    def open_usd(self) -> Mapping[str, float]: ...


@dataclass(frozen=True, slots=True)
class Tolerance:
    usd: float = 0.01
    ratio: float = 0.01

    def exceeded(self, drift: float, recorded: float) -> bool:
        return abs(drift) > max(self.usd, self.ratio * abs(recorded))


class SpendReconciler:
    """Compares, every `interval_s`, the enforced spend of each key the ledger names with its records."""

    def __init__(
        self,
        tally: SpendTally,
        admission: AdmissionView,
        policy: Callable[[], Policy],
        principal: Callable[[str, Policy], Principal | None],
        *,
        interval_s: float = 30.0,
        tolerance: Tolerance | None = None,
        max_keys: int = 1000,
        redis: Redis | None = None,
        prefix: str = "tokenway",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tally = tally
        self.admission = admission
        self.policy = policy
        self.principal = principal
        self.interval_s = interval_s
        self.tolerance = tolerance or Tolerance()
        self.max_keys = max_keys
        self.redis = redis
        self._tag = "{" + prefix + "}:"
        self._replica = os.urandom(6).hex()
        self._clock = clock
        # the status's shape before the first check: what a reader indexes is there, empty
        self.last: dict[str, Any] = {"checked_at_unix_s": None, "periods": {}, "over_tolerance": []}
        self.errors = 0
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the loop
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="spend-reconciler")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], what="spend reconciler")
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self._flush()  # what this replica recorded stays counted after it stops
            await self.redis.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:  # Redis away, a policy mid-reload: the next tick tries again
                self.errors += 1
                log.warning("spend reconciliation failed", exc_info=True)

    # ------------------------------------------------------------------ one comparison
    async def tick(self) -> dict[str, Any]:
        now_s = self._clock()
        if self.redis is not None:
            await self._flush()
            recorded, open_usd = await self._shared(now_s)
        else:
            recorded = {p: dict(self.tally.recorded.get((p, period_id(p, now_s)), {})) for p in PERIODS}
            open_usd = dict(self.admission.open_usd)
        spends: dict[str, dict[str, float] | None] = {}
        periods: dict[str, dict[str, Any]] = {}
        over: list[dict[str, Any]] = []
        for period in PERIODS:
            sums = recorded[period]
            keys = sorted(sums, key=lambda k: -sums[k])[: self.max_keys]
            totals = {"keys": 0, "untracked_keys": 0, "recorded_usd": 0.0, "enforced_usd": 0.0, "open_usd": 0.0}
            drift_sum = 0.0
            for key in keys:
                if key not in spends:
                    spends[key] = await self._enforced(key)
                spend = spends[key]
                enforced = spend.get(period) if spend is not None else None
                if enforced is None:
                    totals["untracked_keys"] += 1
                    continue
                held = open_usd.get(key, 0.0)
                drift = enforced - held - sums[key]
                totals["keys"] += 1
                totals["recorded_usd"] += sums[key]
                totals["enforced_usd"] += enforced
                totals["open_usd"] += held
                drift_sum += abs(drift)
                if self.tolerance.exceeded(drift, sums[key]):
                    over.append(
                        {
                            "key": key,
                            "period": period,
                            "enforced_usd": round(enforced, 9),
                            "open_usd": round(held, 9),
                            "recorded_usd": round(sums[key], 9),
                            "drift_usd": round(drift, 9),
                        }
                    )
            recorded_total = float(totals["recorded_usd"])
            periods[period] = {
                **{k: round(v, 9) if isinstance(v, float) else v for k, v in totals.items()},
                "drift_usd": round(drift_sum, 9),
                "drift_ratio": drift_sum / recorded_total if recorded_total > 0 else 0.0,
                "over_tolerance": sum(1 for row in over if row["period"] == period),
            }
        over.sort(key=lambda row: -abs(row["drift_usd"]))
        self.last = {
            "checked_at_unix_s": round(now_s, 3),
            "store": "redis" if self.redis is not None else "memory",
            "interval_s": self.interval_s,
            "tolerance": {"usd": self.tolerance.usd, "ratio": self.tolerance.ratio},
            "periods": periods,
            "over_tolerance": over[:MAX_LISTED],
            "errors": self.errors,
        }
        return self.last

    async def _enforced(self, key: str) -> dict[str, float] | None:
        """The key's spend counters (day, month) as the store holds them; None when it has none."""
        policy = self.policy()
        principal = self.principal(key, policy)
        if principal is None:
            return None
        model = self.tally.models.get(key)
        if model is None or not principal.may_use(model):  # another replica's key: any model it may use
            model = next((m for m in policy.config.models if principal.may_use(m)), None)
        if model is None:
            return None
        plan = policy.admission_plan(principal, model)
        found = [(i, b) for i, b in enumerate(plan.budgets) if b.scope == "key" and b.subject == key]
        if not found:
            return None
        outcome = await self.admission.store.peek(plan)
        spend: dict[str, float] = {}
        for index, budget in found:
            spend.setdefault(budget.period, float(outcome.budget_spent[index]))
        return spend

    # ------------------------------------------------------------------ shared through Redis
    async def _flush(self) -> None:
        """This replica's new recorded sums and its open reservations, into Redis (one MULTI). A sum
        whose hash or field Redis holds as no float (another type, text: written by something else)
        is refused by Redis alone in the MULTI (the others apply): its hash is repaired and the sum
        goes with the next flush, rather than every later check failing on it."""
        assert self.redis is not None
        pending = list(self.tally.take_pending().items())
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                for (period, pid, key), usd in pending:
                    name = f"{self._tag}spend:{period}:{pid}"
                    pipe.hincrbyfloat(name, key, usd)
                    pipe.expire(name, period_ttl_s(period))
                mine = f"{self._tag}spend-open:{self._replica}"
                pipe.delete(mine)
                held: dict[str | bytes, str | float] = {k: v for k, v in self.admission.open_usd.items() if v > 0}
                if held:
                    pipe.hset(mine, mapping=held)  # type: ignore[arg-type]  # redis-py's Mapping is invariant
                    pipe.expire(mine, max(1, math.ceil(self.interval_s * 3)))
                results = await pipe.execute(raise_on_error=False)
        except Exception:
            for slot, usd in pending:  # counted next time (a lost EXEC reply may count twice)
                self.tally.pending[slot] = self.tally.pending.get(slot, 0.0) + usd
            raise
        refused = [(slot, usd, results[2 * i]) for i, (slot, usd) in enumerate(pending)]
        refused = [(slot, usd, error) for slot, usd, error in refused if isinstance(error, Exception)]
        for slot, usd, _ in refused:  # the only sums Redis did not apply: counted next time
            self.tally.pending[slot] = self.tally.pending.get(slot, 0.0) + usd
        for error in (r for r in results if isinstance(r, Exception)):
            if not _damage(error):
                raise error
        if refused:
            await self._repair({f"{self._tag}spend:{period}:{pid}" for (period, pid, _), _, _ in refused})

    async def _repair(self, names: set[str]) -> None:
        """Drop what no replica writes from the spend hashes `names`: a key of another type, a field
        that is no finite number."""
        assert self.redis is not None
        for name in names:
            if (await self.redis.type(name)) not in (b"hash", "hash", b"none", "none"):
                await self.redis.delete(name)
                continue
            broken = [k for k, v in (await self.redis.hgetall(name)).items() if stored_number(v) is None]
            if broken:
                await self.redis.hdel(name, *broken)

    async def _shared(self, now_s: float) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        assert self.redis is not None
        recorded: dict[str, dict[str, float]] = {}
        for period in PERIODS:
            raw = await self._hash(f"{self._tag}spend:{period}:{period_id(period, now_s)}")
            recorded[period] = {_text(k): usd for k, v in raw.items() if (usd := stored_number(v)) is not None}
        open_usd: dict[str, float] = {}
        async for name in self.redis.scan_iter(match=f"{self._tag}spend-open:*", count=1000):
            for k, v in (await self._hash(name)).items():
                usd = stored_number(v)
                if usd is not None:
                    open_usd[_text(k)] = open_usd.get(_text(k), 0.0) + usd
        return recorded, open_usd

    async def _hash(self, name: str) -> dict[Any, Any]:
        """A hash's fields; none for a key of another type (what no replica writes reads as absent)."""
        assert self.redis is not None
        try:
            found: dict[Any, Any] = await self.redis.hgetall(name)
        except ResponseError as exc:
            if not _damage(exc):
                raise
            return {}
        return found

    # ------------------------------------------------------------------ gauges
    def collect(self) -> Iterator[Metric]:
        drift = GaugeMetricFamily(
            "tokenway_spend_drift_usd",
            "sum over keys of |enforced spend - open reservations - ledger-recorded spend| this period",
            labels=("period",),
        )
        ratio = GaugeMetricFamily(
            "tokenway_spend_drift_ratio",
            "tokenway_spend_drift_usd over the ledger-recorded spend of the keys compared (0: the books agree)",
            labels=("period",),
        )
        keys = GaugeMetricFamily(
            "tokenway_spend_drift_keys", "keys whose spend drift is past the tolerance", labels=("period",)
        )
        for period, row in (self.last.get("periods") or {}).items():
            drift.add_metric((period,), float(row["drift_usd"]))
            ratio.add_metric((period,), float(row["drift_ratio"]))
            keys.add_metric((period,), float(row["over_tolerance"]))
        yield drift
        yield ratio
        yield keys

    def status(self) -> dict[str, Any]:
        return self.last


def _damage(exc: Exception) -> bool:
    """Whether Redis refused a command for what a key holds (another type, a field that is no float)."""
    return isinstance(exc, ResponseError) and ("WRONGTYPE" in str(exc) or "not a" in str(exc))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _Gauges:
    def __init__(self, owner: SpendReconciler) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        return self._owner.collect()


RECONCILER: web.AppKey[SpendReconciler | None] = web.AppKey("spend_reconciler", object)  # type: ignore[arg-type]


async def reconcile_ctx(app: web.Application) -> AsyncIterator[None]:
    """The tally on the ledger and the periodic reconciler (`ledger.reconcile`); none without a ledger."""
    settings = app[appkeys.SETTINGS]
    config = settings.ledger.reconcile
    ledger = app[appkeys.LEDGER]
    app[RECONCILER] = None
    if ledger is None or not config.enabled:
        yield
        return
    tally = ledger.tally = SpendTally(config.max_keys)
    holder, directory, state = app[appkeys.POLICIES], app[appkeys.DIRECTORY], settings.state

    def principal(key: str, policy: Policy) -> Principal | None:
        return policy.principal_of(key) or directory.principal(key, policy)

    redis = Redis.from_url(state.redis_url) if state.backend == "redis" and state.redis_url else None
    reconciler = SpendReconciler(
        tally,
        app[appkeys.ADMISSION],
        lambda: holder.current,
        principal,
        interval_s=config.interval_s,
        tolerance=Tolerance(config.tolerance_usd, config.tolerance_ratio),
        max_keys=config.max_keys,
        redis=redis,
        prefix=state.key_prefix,
    )
    app[RECONCILER] = reconciler
    app[appkeys.METRICS].registry.register(_Gauges(reconciler))
    reconciler.start()
    yield
    await reconciler.close()

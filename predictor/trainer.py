"""Retraining off the event loop: a training job as a pure function, and the worker that runs it.

A `TrainJob` carries copies of one pool's samples and its current models; `run_train_job` trains a
challenger per target, serves it unless its held-out errors are worse than the incumbent's (or, with
no model yet, the prior's) beyond noise, and returns a complete `PoolModel` (compiled forest
included) ready to be swapped in with one reference assignment. Everything it touches is its own
copy, so it runs in any thread or process.

Why "beyond noise" and not "lower MAPE wins": the held-out ring spans the buffer's whole history,
so it measures fit to the past, while the challenger is the one trained on the present; on a few
hundred samples two models' MAPEs differ by chance by more than their real difference. Replayed
offline on three predictor benchmark exports (the gateway's own pipeline: a retrain every 200
outcomes, block held-out), the strict rule kept the stale model in 6 of 10 retrains at 90 % load;
keeping the incumbent only when the challenger is worse by more than two standard errors of the
paired per-sample difference took TTFT MAPE at 90 % load from 19.5 to 17.5 % (mean of nine runs;
up to 6 points in one), TPOT 22.3 -> 22.7 %, and TPOT at 50 % load 16.4 -> 14.2 %. A challenger
that is plainly worse (trained on a broken stretch) is still refused.

Worker choice: one spawned process by default. XGBoost releases the GIL inside each boosting round,
but a job also holds it for tens of milliseconds in pure Python and C calls that do not release it
(parsing the JSON models, compiling the forest, numpy on the samples): 20-40 ms per job, which a
worker thread gets back in 5 ms slices (the interpreter's switch interval), each one a stall of the
event loop. Measured on the 2-core dev box, three retrains of a 20k-sample pool (XGBoost 1 thread,
a 1 ms asyncio heartbeat): worker thread p99 heartbeat lag 7-10 ms, max 8-18 ms, 575-715 ticks/s;
worker process p99 2.3-2.9 ms, max 4-7 ms, 810-840 ticks/s (idle: p99 0.7 ms, 860 ticks/s). The
process costs a spawn at `start()` (~1-2 s, off the loop), pickling the samples (a few MB, done by
the executor's feeder thread) and returns a ready `PoolModel` (compiled arrays) by pickle.
`worker: thread` remains for tests and small deployments: no process start, one copy of XGBoost.
The worker process ends with the gateway, also when the gateway is killed with SIGKILL
(`backends.process.die_with_parent`: parent-death signal and a watchdog on the parent's pid).
`xgboost.threads` (OpenMP threads per training, default 1) leaves the other cores to the loop.
"""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing
import os
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Literal

from backends.process import die_with_parent
from predictor.accuracy import absolute_percentage_errors
from predictor.buffers import Samples
from predictor.config import XGBoostSettings
from predictor.model import PRIOR_COLUMN, PoolModel, TargetModel, predict_ms, train_target, usable
from predictor.types import Float64Array, Target

MIN_HELDOUT_TO_COMPARE = 30
# how many standard errors of the paired difference a challenger must be worse by to be refused
REFUSE_BEYOND_SE = 2.0


class Decision(StrEnum):
    TRAINED = "trained"  # the challenger replaced the incumbent (or the prior)
    KEPT_INCUMBENT = "kept-incumbent"  # the current model scored better on held-out samples
    KEPT_PRIOR = "kept-prior"  # no model yet, and the prior scored better than the challenger
    TOO_FEW_SAMPLES = "too-few-samples"


@dataclass(frozen=True, slots=True)
class TrainJob:
    pool: str
    version: int  # the version the new model gets
    train: Samples
    heldout: Samples
    incumbent: dict[Target, TargetModel]
    xgboost: XGBoostSettings
    min_samples: int
    conformal_p90: bool


@dataclass(frozen=True, slots=True)
class TrainOutcome:
    pool: str
    model: PoolModel | None  # None when no target changed
    decisions: dict[Target, Decision] = field(default_factory=dict)
    duration_s: float = 0.0


def run_train_job(job: TrainJob) -> TrainOutcome:
    """Train, compare on held-out samples, assemble. CPU-bound: never call it on the event loop."""
    started = time.perf_counter()
    chosen = dict(job.incumbent)
    decisions: dict[Target, Decision] = {}
    for target in Target:
        challenger = train_target(job.train, job.heldout, target, job.xgboost, job.min_samples, job.conformal_p90)
        if challenger is None:
            decisions[target] = Decision.TOO_FEW_SAMPLES
            continue
        decisions[target] = _judge(challenger, job.incumbent.get(target), job.heldout)
        if decisions[target] is Decision.TRAINED:
            chosen[target] = replace(challenger, heldout_mean_ms=None)  # judged: the served model needs none
    changed = any(d is Decision.TRAINED for d in decisions.values())
    model = PoolModel.assemble(job.version, chosen) if changed else None
    return TrainOutcome(job.pool, model, decisions, time.perf_counter() - started)


def _judge(challenger: TargetModel, incumbent: TargetModel | None, heldout: Samples) -> Decision:
    """Whether the challenger should serve: yes, unless its held-out errors are worse than those of
    the model it replaces (or the prior, when there is none) beyond noise (module docstring). Too
    few held-out samples to tell: the fresher model wins."""
    score = challenger.heldout
    if score is None or score.samples < MIN_HELDOUT_TO_COMPARE:
        return Decision.TRAINED
    rows, actual = usable(heldout, challenger.target)
    predicted = challenger.heldout_mean_ms  # train_target predicted the slice already
    if predicted is None:
        predicted = predict_ms(challenger, rows)[0]
    challenger_ape = absolute_percentage_errors(predicted, actual)
    if incumbent is None:
        prior_ape = absolute_percentage_errors(rows[:, PRIOR_COLUMN[challenger.target]], actual)
        return Decision.KEPT_PRIOR if worse_beyond_noise(challenger_ape, prior_ape) else Decision.TRAINED
    incumbent_ape = absolute_percentage_errors(predict_ms(incumbent, rows)[0], actual)
    return Decision.KEPT_INCUMBENT if worse_beyond_noise(challenger_ape, incumbent_ape) else Decision.TRAINED


def worse_beyond_noise(errors: Float64Array, other_errors: Float64Array) -> bool:
    """True when `errors` (per sample) exceed `other_errors` (the same samples, another model) on
    average by more than `REFUSE_BEYOND_SE` standard errors of the paired difference."""
    diff = errors - other_errors
    if diff.size < 2:
        return False
    return float(diff.mean()) > REFUSE_BEYOND_SE * float(diff.std(ddof=1)) / math.sqrt(diff.size)


def _warm_up() -> bool:
    import xgboost  # noqa: F401  (pay the import in the worker process at start, not on a job)

    return True


class TrainingWorker:
    """Owns the executor that runs `run_train_job` (module docstring for the choice)."""

    def __init__(self, kind: Literal["thread", "process"] = "thread") -> None:
        self.kind = kind
        self._executor: Executor | None = None
        self.jobs_run = 0

    async def start(self) -> None:
        if self._executor is not None:
            return
        if self.kind == "process":
            self._executor = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=die_with_parent,
                initargs=(os.getpid(),),
            )
            await asyncio.get_running_loop().run_in_executor(self._executor, _warm_up)
        else:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predictor-train")

    async def run(self, job: TrainJob) -> TrainOutcome:
        if self._executor is None:
            await self.start()
        assert self._executor is not None
        try:
            outcome = await asyncio.get_running_loop().run_in_executor(self._executor, run_train_job, job)
        except BrokenProcessPool:
            self._executor = None  # the process died (OOM, signal): the next job starts a new one
            raise
        self.jobs_run += 1
        return outcome

    async def stop(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            # waiting for a running job would block the loop: shut down from a helper thread
            shutdown = functools.partial(executor.shutdown, wait=True, cancel_futures=True)
            await asyncio.get_running_loop().run_in_executor(None, shutdown)

    def __repr__(self) -> str:
        return f"TrainingWorker({self.kind!r}, running={self._executor is not None})"

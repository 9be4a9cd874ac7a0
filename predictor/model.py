"""The learnt part of the predictor: per-pool XGBoost models on the log-ratio of the outcome over the
prior, the compiled numpy form the hot path evaluates, and their retraining off the event loop.

Compiled trees
--------------
XGBoost ensembles compiled to numpy arrays, so the hot path never calls into XGBoost.

Why: XGBoost's `inplace_predict` has a fixed cost of ~200 µs per call on this class of machine
(argument JSON, a proxy DMatrix, thread setup), whatever the model size, and a pool has four
regressors: ~1 ms per routed request. Here every tree of every regressor is laid out as a full
binary heap of the same depth (a leaf above the bottom becomes an always-left chain), so one pass
of `depth` vectorised steps walks all trees for all candidates at once:

    pos = 0;  repeat depth times:  pos = 2·pos + 1 + (x[feature[pos]] >= threshold[pos])

and a 0/1 matrix sums each regressor's leaves. XGBoost's rule is the same (`x < split` goes left,
the right child otherwise); rows never hold NaN (features.py), so default directions do not arise.

Models
------
Per-pool XGBoost models: what they learn, how they are trained, how they predict.

Each target (TTFT, TPOT) has two regressors over the feature row: a point estimate (absolute error
by default) and a p90 (`reg:quantileerror`, alpha = 0.9). Neither predicts milliseconds directly;
both predict

    z = ln(actual_ms) - ln(prior_ms)

the log-ratio of the outcome over the analytic prior in the same row. Why, and how it beats llm-d's
raw-millisecond quantile model:
- the prior carries the physics (prompt length, batch, roofline), so the trees only learn a
  correction, which needs fewer samples and smaller trees;
- trees cannot extrapolate, but the prior does: a prompt longer than any seen still scales;
- errors on latency are multiplicative (queueing), so a log target makes squared error behave like
  relative error, which is what MAPE and SLO headroom measure;
- quantiles are invariant under the monotone map back to milliseconds, so the p90 of z is the p90;
- the point estimate minimises absolute error on z, so it is the median ratio over the prior: a
  relative-error score (MAPE) rewards the median, and a mean in log space is pulled by the long
  queueing tail. On the predictor benchmark's exported outcomes, replayed offline with online
  retraining, absolute instead of squared error took TTFT MAPE from 12.7 / 15.9 / 23.0 % to
  8.7 / 12.6 / 20.9 % at 50 / 70 / 90 % load (TPOT 17.7 / 17.7 / 20.3 -> 15.3 / 17.1 / 21.0 %).
The p90 is then shifted by a split-conformal offset from the held-out slice (when it is big enough)
so that its out-of-sample coverage, not only its training fit, is 90 %.

The p90 is never under the point estimate times a *floor*: the same held-out slice's 90th
percentile of ln(actual / point estimate), the split-conformal p90 of the point model; the
conformal shift is then computed for the p90 as served (the larger of the two), so its held-out
coverage stays 90 %. Why: the quantile regressor is trained on its own, and between retrains its
spread over the point estimate swung with no cause in the data. On the predictor benchmark's
exported outcomes (90 % load), the served TPOT p90 was 1.0-1.2x the point estimate under one model
version (26-40 % coverage) and 2-3x under the next (100 %). Replayed offline through the gateway's
pipeline (retrains, held-out ring, delayed outcomes, the online shift of service.py at 0.005), the
floor took pooled online p90 coverage from 81.3 to 88.2 % (TPOT) and 87.7 to 89.2 % (TTFT), while
the quantile model still widens the p90 where its rows are riskier.

Retraining
----------
Retraining off the event loop: a training job as a pure function, and the worker that runs it.

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
import json
import math
import multiprocessing
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from backends.process import die_with_parent
from predictor.config import XGBoostSettings
from predictor.features import (
    AccuracyScore,
    Feature,
    Float64Array,
    FloatArray,
    Quantity,
    Samples,
    Target,
    absolute_percentage_errors,
)

IntArray = npt.NDArray[np.intp]


@dataclass(frozen=True, slots=True)
class _Tree:
    left: list[int]
    right: list[int]
    feature: list[int]
    condition: list[float]  # split threshold for inner nodes, leaf value for leaves

    def depth(self, node: int = 0) -> int:
        if self.left[node] < 0:
            return 0
        return 1 + max(self.depth(self.left[node]), self.depth(self.right[node]))


def _parse_model(model_json: bytes) -> tuple[float, list[_Tree]]:
    """Base score and trees of a single-output XGBoost `gbtree` model saved as JSON."""
    model: dict[str, Any] = json.loads(model_json)
    learner = model["learner"]
    booster = learner["gradient_booster"]
    if booster["name"] != "gbtree":
        raise ValueError(f"only gbtree models compile, got {booster['name']!r}")
    params = learner["learner_model_param"]
    if int(params.get("num_target", "1")) != 1 or int(params.get("num_class", "0")) > 1:
        raise ValueError("only single-output regressors compile")
    base = float(str(params["base_score"]).strip("[]"))
    trees = [
        _Tree(t["left_children"], t["right_children"], t["split_indices"], t["split_conditions"])
        for t in booster["model"]["trees"]
    ]
    return base, trees


@dataclass(frozen=True, slots=True)
class CompiledForest:
    """Several single-output regressors evaluated together; `predict` returns one column each.

    Node arrays are indexed by a global node id: tree t's heap node h is `t·(2**(depth+1) - 1) + h`,
    so a step is `node = left[node] + (x >= threshold[node])` (the right child follows the left).
    """

    depth: int
    feature: IntArray  # (nodes,) feature index of each inner node (0 for padding and leaves)
    threshold: FloatArray  # (nodes,) go right when x >= threshold (+inf for padding: always left)
    left: IntArray  # (nodes,) global id of the left child (leaves: themselves)
    value: FloatArray  # (nodes,) leaf values at the bottom level, 0 elsewhere
    roots: IntArray  # (trees,) global id of each tree's root
    output_of_tree: FloatArray  # (trees, outputs) 0/1: which regressor a tree belongs to
    base_score: FloatArray  # (outputs,)

    @property
    def num_outputs(self) -> int:
        return int(self.base_score.shape[0])

    @property
    def num_trees(self) -> int:
        return int(self.roots.shape[0])

    @classmethod
    def compile(cls, models_json: Sequence[bytes]) -> CompiledForest:
        """Compile XGBoost JSON models (`Booster.save_raw("json")`), one output column each."""
        parsed = [_parse_model(m) for m in models_json]
        trees = [(output, tree) for output, (_, ts) in enumerate(parsed) for tree in ts]
        depth = max((tree.depth() for _, tree in trees), default=0)
        per_tree = 2 ** (depth + 1) - 1
        inner = 2**depth - 1
        n = len(trees)
        feature = np.zeros(n * per_tree, dtype=np.intp)
        threshold = np.full(n * per_tree, np.inf, dtype=np.float32)
        heap = np.arange(per_tree, dtype=np.intp)
        local_left = np.where(heap < inner, 2 * heap + 1, heap)
        roots = np.arange(n, dtype=np.intp) * per_tree
        left = (roots[:, None] + local_left[None, :]).ravel()
        value = np.zeros(n * per_tree, dtype=np.float32)
        output_of_tree = np.zeros((n, len(parsed)), dtype=np.float32)
        for t, (output, tree) in enumerate(trees):
            output_of_tree[t, output] = 1.0
            _layout(tree, 0, 0, depth, int(roots[t]), feature, threshold, value)
        return cls(
            depth=depth,
            feature=feature,
            threshold=threshold,
            left=left,
            value=value,
            roots=roots,
            output_of_tree=output_of_tree,
            base_score=np.array([base for base, _ in parsed], dtype=np.float32),
        )

    def predict(self, rows: FloatArray) -> FloatArray:
        """(len(rows), num_outputs) float32 margins, equal to XGBoost's predictions."""
        n_rows, n_features = rows.shape
        flat = np.ascontiguousarray(rows, dtype=np.float32).ravel()
        row_offset = (np.arange(n_rows, dtype=np.intp) * n_features)[:, None]
        node = self.roots  # (trees,): broadcasts against row_offset into (rows, trees) at the first step
        for _ in range(self.depth):
            go_right = flat[row_offset + self.feature[node]] >= self.threshold[node]
            node = self.left[node] + go_right
        leaves = self.value[np.broadcast_to(node, (n_rows, self.num_trees))]
        out: FloatArray = leaves @ self.output_of_tree + self.base_score
        return out


def _layout(
    tree: _Tree,
    node: int,
    heap: int,
    depth: int,
    root: int,
    feature: IntArray,
    threshold: FloatArray,
    value: FloatArray,
) -> None:
    """Place `node` of `tree` at heap position `heap`; a leaf fills its whole heap subtree."""
    inner = 2**depth - 1
    if heap >= inner:  # bottom level: a leaf slot
        value[root + heap] = tree.condition[node]
        return
    if tree.left[node] < 0:  # a leaf above the bottom: always-left padding down to its leaf slots
        first, count = heap, 1
        while first < inner:
            first, count = 2 * first + 1, count * 2
        value[root + first : root + first + count] = tree.condition[node]
        return
    feature[root + heap] = tree.feature[node]
    threshold[root + heap] = tree.condition[node]
    _layout(tree, tree.left[node], 2 * heap + 1, depth, root, feature, threshold, value)
    _layout(tree, tree.right[node], 2 * heap + 2, depth, root, feature, threshold, value)


PRIOR_COLUMN: Mapping[Target, Feature] = MappingProxyType(
    {Target.TTFT: Feature.PRIOR_TTFT_MS, Target.TPOT: Feature.PRIOR_TPOT_MS}
)
P90_ALPHA = 0.9
MIN_CONFORMAL_SAMPLES = 50
# z is clipped to ±this when trained on: a single 1000x outlier (a stalled engine) must not dominate
_MAX_ABS_LOG_RATIO = 6.0


def _actual(samples: Samples, target: Target) -> Float64Array:
    return samples.ttft_ms if target is Target.TTFT else samples.tpot_ms


def usable(samples: Samples, target: Target) -> tuple[FloatArray, Float64Array]:
    """Rows with an observed, positive value of `target` and a positive prior; and those values."""
    actual = _actual(samples, target)
    prior = samples.rows[:, PRIOR_COLUMN[target]]
    keep = np.isfinite(actual) & (actual > 0) & (prior > 0)
    return samples.rows[keep], actual[keep]


def log_ratio(rows: FloatArray, actual_ms: Float64Array, target: Target) -> Float64Array:
    prior = rows[:, PRIOR_COLUMN[target]].astype(np.float64)
    z: Float64Array = np.clip(np.log(actual_ms) - np.log(prior), -_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)
    return z


def _params(settings: XGBoostSettings, quantity: Quantity) -> dict[str, object]:
    params: dict[str, object] = {
        "tree_method": "hist",
        "max_depth": settings.max_depth,
        "eta": settings.learning_rate,
        "subsample": settings.subsample,
        "colsample_bytree": settings.colsample_bytree,
        "min_child_weight": settings.min_child_weight,
        "lambda": settings.reg_lambda,
        "alpha": settings.reg_alpha,
        "gamma": settings.gamma,
        "max_bin": settings.max_bin,
        "nthread": settings.threads,
        "seed": 0,
    }
    if quantity is Quantity.P90:
        params |= {"objective": "reg:quantileerror", "quantile_alpha": P90_ALPHA}
    else:
        params |= {"objective": settings.point_objective}
    return params


@dataclass(frozen=True, slots=True)
class TargetModel:
    """The two trained regressors of one target, with what is known about their quality.

    `mean_json`/`p90_json` are XGBoost JSON models (the persisted form, compiled for prediction).
    `p90_offset` is the conformal shift added to the p90's log-ratio; `p90_floor` the log of the
    least p90 / mean ratio (module docstring; at most 0: the p90 is at least the mean). `heldout`
    scores this model and `prior_heldout` the prior on the same held-out slice at training time;
    `heldout_mean_ms` keeps its mean predictions there (in the training worker only, not saved) so
    the judge in the retraining (below) compares errors without predicting the slice a second time.
    """

    target: Target
    mean_json: bytes
    p90_json: bytes
    p90_offset: float
    trained_at_s: float  # wall clock (time.time()), so a model's age survives restarts
    train_samples: int
    heldout: AccuracyScore | None = None
    prior_heldout: AccuracyScore | None = None
    p90_floor: float = 0.0
    heldout_mean_ms: Float64Array | None = field(default=None, compare=False, repr=False)

    @property
    def p90_least_ratio(self) -> float:
        """The least p90 / mean ratio served (1: the p90 is at least the mean)."""
        return math.exp(max(self.p90_floor, 0.0))

    def forest(self) -> CompiledForest:
        return CompiledForest.compile([self.mean_json, self.p90_json])


def predict_ms(model: TargetModel, rows: FloatArray) -> tuple[Float64Array, Float64Array]:
    """(mean_ms, p90_ms) of one target model (off the hot path: compiles its forest each call)."""
    z = model.forest().predict(rows).astype(np.float64)
    prior = rows[:, PRIOR_COLUMN[model.target]].astype(np.float64)
    mean_ms: Float64Array = prior * np.exp(z[:, 0])
    p90_ms: Float64Array = np.maximum(prior * np.exp(z[:, 1] + model.p90_offset), mean_ms * model.p90_least_ratio)
    return mean_ms, p90_ms


def train_target(
    train: Samples,
    heldout: Samples,
    target: Target,
    settings: XGBoostSettings,
    min_samples: int,
    conformal_p90: bool,
) -> TargetModel | None:
    """Train one target's regressors on `train`, score them on `heldout`; None if too few samples."""
    rows, actual = usable(train, target)
    if len(actual) < min_samples:
        return None
    z = log_ratio(rows, actual, target)
    # imported here, not at the top: only the trainer (a worker process by default) trains, and the
    # gateway's own start-up then skips XGBoost's import; serving reads the compiled forest
    import xgboost as xgb

    data = xgb.DMatrix(rows, label=z, nthread=settings.threads)
    boosters = {
        quantity: xgb.train(_params(settings, quantity), data, num_boost_round=settings.n_trees)
        for quantity in Quantity
    }
    mean_json = bytes(boosters[Quantity.MEAN].save_raw("json"))
    p90_json = bytes(boosters[Quantity.P90].save_raw("json"))
    model = TargetModel(target, mean_json, p90_json, 0.0, time.time(), len(actual))
    held_rows, held_actual = usable(heldout, target)
    if not len(held_actual):
        return model
    raw_mean, raw_p90 = predict_ms(model, held_rows)
    offset = floor = 0.0
    if conformal_p90 and len(held_actual) >= MIN_CONFORMAL_SAMPLES:
        log_actual = np.log(held_actual)
        floor = max(_conformal_p90(log_actual - np.log(raw_mean)), 0.0)
        # one shift for the p90 as served, max(quantile model, mean x floor): 90 % held-out coverage
        offset = _conformal_p90(log_actual - np.log(np.maximum(raw_p90, raw_mean * math.exp(floor))))
        floor += offset
    prior = held_rows[:, PRIOR_COLUMN[target]]
    return TargetModel(
        target,
        mean_json,
        p90_json,
        offset,
        model.trained_at_s,
        len(actual),
        heldout=AccuracyScore.of(raw_mean, raw_p90, held_actual),
        prior_heldout=AccuracyScore.of(prior, prior, held_actual),
        p90_floor=floor,
        heldout_mean_ms=raw_mean,
    )


def _conformal_p90(residual: Float64Array) -> float:
    """The split-conformal shift that makes 90 % of `residual` (log actual - log prediction) fit."""
    level = min(1.0, np.ceil((len(residual) + 1) * P90_ALPHA) / len(residual))
    return float(np.quantile(residual, level))


# Canonical output slots of a latency matrix: one row per candidate, these four columns.
SLOTS: tuple[tuple[Target, Quantity], ...] = (
    (Target.TTFT, Quantity.MEAN),
    (Target.TTFT, Quantity.P90),
    (Target.TPOT, Quantity.MEAN),
    (Target.TPOT, Quantity.P90),
)
SLOT_OF = {key: i for i, key in enumerate(SLOTS)}


@dataclass(frozen=True, slots=True)
class PoolModel:
    """The models one pool predicts with, compiled into one forest (one pass for all targets).

    Output k of `forest` is the log-ratio of latency slot `slots[k]` (see `SLOTS`) over the prior
    in column `prior_columns[k]`, shifted by `offsets[k]` (the conformal p90 shift). A target
    without a model has no outputs; the caller fills its slots from the prior. Never mutated after
    `assemble` (plain containers, so that it pickles back from a training process).
    """

    version: int
    targets: dict[Target, TargetModel]
    forest: CompiledForest
    slots: IntArray  # (outputs,) latency slot of each output
    prior_columns: IntArray  # (outputs,) feature column of the prior each output scales
    offsets: FloatArray  # (outputs,) log-space shift added to each output
    floors: Float64Array  # (outputs / 2,) least p90 / mean ratio of each (mean, p90) pair

    @classmethod
    def assemble(cls, version: int, targets: Mapping[Target, TargetModel]) -> PoolModel:
        models_json: list[bytes] = []
        slots: list[int] = []
        offsets: list[float] = []
        floors: list[float] = []
        for target in Target:
            model = targets.get(target)
            if model is None:
                continue
            models_json += (model.mean_json, model.p90_json)
            slots += (SLOT_OF[target, Quantity.MEAN], SLOT_OF[target, Quantity.P90])
            offsets += (0.0, model.p90_offset)
            floors.append(model.p90_least_ratio)
        slot_array = np.array(slots, dtype=np.intp)
        return cls(
            version=version,
            targets=dict(targets),
            forest=CompiledForest.compile(models_json),
            slots=slot_array,
            prior_columns=np.array([PRIOR_COLUMN[SLOTS[k][0]] for k in slots], dtype=np.intp),
            offsets=np.array(offsets, dtype=np.float32),
            floors=np.array(floors, dtype=np.float64),
        )

    def latency_ms(self, rows: FloatArray) -> Float64Array:
        """(len(rows), outputs) milliseconds, in the order of `slots`; each p90 at least its mean
        times its floor."""
        z = self.forest.predict(rows) + self.offsets
        ms: Float64Array = rows[:, self.prior_columns].astype(np.float64) * np.exp(z.astype(np.float64))
        # outputs come in (mean, p90) pairs
        np.maximum(ms[:, 1::2], ms[:, 0::2] * self.floors, out=ms[:, 1::2])
        return ms

    @property
    def trained_at_s(self) -> float:
        return max((m.trained_at_s for m in self.targets.values()), default=0.0)


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

"""`LatencyPredictor`, the one object the gateway holds, and what the last moments say that the models
cannot know yet (recent first tokens, recent prefill load).

Recent corrections
------------------
What the last moments say that the models cannot know yet: a pool's TTFT predictions corrected by
how wrong the last second's first tokens found them (`RecentTtftCorrection`), and each endpoint's
recent prefill load (`PrefillRateTracker`, below).

A pool's TTFT predictions corrected by how wrong the last second's first tokens found them.

Why: the models learn from a request when it ends, which under heavy load is 5-60 s after its first
token; a burst that builds a queue is over before its outcomes reach a retrain, and the features of
the moment (running, waiting, KV usage: saturated at 90 % load) do not tell a queue that drains in
one step from one that drains in ten. The first tokens the gateway relays do: each says, within a
step, how far off the prediction made for it was. So every TTFT prediction of a pool is multiplied by

    exp(weight x median(ln(actual / predicted)) over the first tokens of the last `window_s`)

(at least `_MIN_RESIDUALS` of them; the residuals are taken against the uncorrected predictions, so
the correction does not feed on itself). Replayed offline on the predictor benchmark's exported
outcomes (each request's first token known when it happened), weight 0.5 over 1 engine second took
TTFT MAPE at 90 % load from 18.9 to 16.3 % (gate off) and 20.1 to 17.7 % (gate on) and TTFT p90
coverage there from 86 to 91 %, and changed no other load by more than 0.3 points. The same
correction fed by outcomes known only at completion, as the models are, changed nothing: it is the
freshness that helps. One factor per pool: per endpoint was no better.

Memory is bounded (`max_residuals`, the newest kept). The residuals are also kept sorted (bisect),
so the median is one read; it is recomputed only when a residual arrived or one aged out, and
`factor` costs a comparison on most calls of the hot path.

The facade
----------
`LatencyPredictor`: the one object the gateway holds.

- `predict` (hot path, sync): features for all candidates of a request in one pass, the prior, and
  the pool's compiled model if it has one; one vectorised evaluation for all candidates.
- `observe` (sync, O(1)): the outcome of a served request with the features captured at routing
  time: scores the prediction made before it ran and stores the sample; the retraining task
  checks every `retrain_interval_s` for pools with enough new samples.
- `start`/`stop`: load saved models; run the retraining task, which snapshots a pool's buffers on
  the loop (a numpy copy) and trains in the worker (model.py); the new model replaces the old by
  one reference assignment, so a concurrent `predict` sees either the old or the new, never a mix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from backends.config import PoolConfig
from backends.types import Endpoint
from predictor.config import PredictorSettings
from predictor.features import (
    FEATURE_NAMES,
    NUM_FEATURES,
    AccuracyScore,
    Float64Array,
    FloatArray,
    OnlineAccuracy,
    Prediction,
    PredictionSource,
    Quantity,
    RequestShape,
    Samples,
    StratifiedBuffer,
    Target,
    build_features,
)
from predictor.model import PRIOR_COLUMN, SLOT_OF, SLOTS, PoolModel, TrainingWorker, TrainJob, TrainOutcome
from predictor.persist import ModelStore
from predictor.prior import LatencyPrior, LengthEstimate, OutputLengthEstimator, OutputPrediction

_MIN_RESIDUALS = 3


class RecentTtftCorrection:
    """The multiplicative correction of one pool's TTFT predictions (module docstring)."""

    def __init__(self, window_s: float, weight: float, max_residuals: int = 1024) -> None:
        self.window_s = window_s  # monotonic (wall) seconds
        self.weight = weight
        self.max_residuals = max_residuals
        self._residuals: deque[tuple[float, float]] = deque()  # (at_s, ln ratio), oldest first
        self._sorted: list[float] = []  # the same ln ratios, ascending
        self._factor = 1.0
        self._valid_until_s = -math.inf  # when the oldest residual ages out
        self._dirty = False

    @property
    def enabled(self) -> bool:
        return self.window_s > 0 and self.weight > 0

    def add(self, at_s: float, actual_ms: float, uncorrected_ms: float) -> None:
        """A first token at monotonic `at_s`, `actual_ms` after dispatch, predicted `uncorrected_ms`."""
        if not self.enabled or not (actual_ms > 0 and uncorrected_ms > 0):
            return
        if len(self._residuals) >= self.max_residuals:
            self._drop_oldest()
        residual = math.log(actual_ms / uncorrected_ms)
        self._residuals.append((at_s, residual))
        insort(self._sorted, residual)
        self._dirty = True

    def _drop_oldest(self) -> None:
        _, residual = self._residuals.popleft()
        del self._sorted[bisect_left(self._sorted, residual)]

    def factor(self, now_s: float) -> float:
        """What to multiply a TTFT prediction made at monotonic `now_s` by (1.0: no correction)."""
        if not self._dirty and now_s < self._valid_until_s:
            return self._factor
        residuals = self._residuals
        horizon_s = now_s - self.window_s
        while residuals and residuals[0][0] < horizon_s:
            self._drop_oldest()
        self._dirty = False
        ranked = self._sorted
        count = len(ranked)
        if count < _MIN_RESIDUALS:
            self._factor = 1.0
        else:
            middle = count // 2
            median = ranked[middle] if count % 2 else 0.5 * (ranked[middle - 1] + ranked[middle])
            self._factor = math.exp(self.weight * median)
        self._valid_until_s = residuals[0][0] + self.window_s if residuals else math.inf
        return self._factor


@dataclass(slots=True)
class _EndpointRate:
    scraped_at_s: float
    uncached_tokens: float
    rate_tps: float = 0.0
    warm: bool = False  # at least one interval seen


class PrefillRateTracker:
    """Uncached prompt tokens per second each endpoint admitted recently: recent prefill load per
    endpoint, from the engine's own cumulative prefix-cache counters.

    Why: a request's TPOT is set less by the batch it joins than by the prompts that arrive while it
    decodes (every step that carries a prefill chunk is longer, and pays the prefill overhead). The
    instantaneous state (running, waiting, in-flight tokens) lags that; the recent rate of uncached
    prompt tokens an engine admitted does not. vLLM counts every admitted prompt in
    `vllm:prefix_cache_queries` and its cached part in `vllm:prefix_cache_hits` (tokens, cumulative), so
    queries - hits is the uncached prompt work, counted by the engine itself: it includes traffic from
    other gateway replicas, which gateway-side accounting would miss.

    The rate is an exponentially weighted average over scrapes with time constant `time_constant_s`,
    updated lazily when `rate_tps` sees a newer scrape; a counter that goes down (engine restart)
    restarts the estimate. Endpoints that report no counters (remote APIs) read 0.
    """

    def __init__(self, time_constant_s: float = 5.0, max_endpoints: int = 10_000) -> None:
        self.time_constant_s = time_constant_s
        self.max_endpoints = max_endpoints
        self._by_endpoint: dict[str, _EndpointRate] = {}

    def rate_tps(self, endpoint: Endpoint) -> float:
        stats = endpoint.stats
        scraped_at_s = stats.scraped_at_s
        if not scraped_at_s:
            return 0.0
        uncached = stats.prefix_cache_queries_tokens - stats.prefix_cache_hits_tokens
        state = self._by_endpoint.get(endpoint.id)
        if state is None:
            if len(self._by_endpoint) >= self.max_endpoints:
                self._by_endpoint.clear()  # endpoints churned far beyond any fleet: start over
            self._by_endpoint[endpoint.id] = _EndpointRate(scraped_at_s, uncached)
            return 0.0
        elapsed_s = scraped_at_s - state.scraped_at_s
        if elapsed_s <= 0:
            return state.rate_tps
        delta = uncached - state.uncached_tokens
        state.scraped_at_s = scraped_at_s
        state.uncached_tokens = uncached
        if delta < 0:  # counters reset: the engine restarted
            state.rate_tps, state.warm = 0.0, False
            return 0.0
        instant = delta / elapsed_s
        if state.warm:
            weight = 1.0 - math.exp(-elapsed_s / self.time_constant_s)
            state.rate_tps += weight * (instant - state.rate_tps)
        else:
            state.rate_tps, state.warm = instant, True
        return state.rate_tps


log = logging.getLogger(__name__)

_PRIOR_OF_SLOT = [PRIOR_COLUMN[target] for target, _ in SLOTS]
_MEAN_SLOTS = [SLOT_OF[target, Quantity.MEAN] for target in Target]  # TTFT, TPOT
_P90_SLOTS = [SLOT_OF[target, Quantity.P90] for target in Target]
_TTFT_SLOTS = [SLOT_OF[Target.TTFT, quantity] for quantity in Quantity]
_P90_LEVEL = 0.9
_MAX_P90_SHIFT = 2.0  # e**2: a p90 more than 7x off is a broken model, not drift


class _Outcome(NamedTuple):
    observed_at_s: float  # monotonic
    features: FloatArray
    ttft_ms: float | None
    tpot_ms: float | None
    predicted: Prediction | None


@dataclass(slots=True, eq=False)
class _PoolState:
    name: str
    prior: LatencyPrior
    buffer: StratifiedBuffer
    accuracy: dict[Target, OnlineAccuracy]
    recent_ttft: RecentTtftCorrection
    model: PoolModel | None = None
    version: int = 0  # newest version trained or loaded (saved models continue the sequence)
    saved_version: int = 0
    new_samples: int = 0  # stored since the last training snapshot
    last_train_started_s: float = float("-inf")  # monotonic
    last_outcome: TrainOutcome | None = None
    last_error: str | None = None
    trainings: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # online p90 correction: log-space shift of the TTFT and TPOT p90s (see `_adapt_p90`)
    p90_shift: Float64Array = field(default_factory=lambda: np.zeros(2))
    p90_scale: Float64Array = field(default_factory=lambda: np.ones(2))
    # the last `export_samples` outcomes, in arrival order, for GET /admin/predictor/samples
    recent: deque[_Outcome] = field(default_factory=deque)
    samples_saved_at: int = 0  # buffer.added when the samples were last saved (nothing new: no write)

    @property
    def training(self) -> bool:
        return self.lock.locked()


class LatencyPredictor:
    """Predicts TTFT/TPOT per candidate endpoint and learns from every served request."""

    def __init__(
        self,
        settings: PredictorSettings,
        pools: Mapping[str, PoolConfig],
        *,
        worker: TrainingWorker | None = None,
    ) -> None:
        self.settings = settings
        self._pool_configs = dict(pools)
        self._pools: dict[str, _PoolState] = {}
        for name in pools:
            self._state(name)
        self.lengths = OutputLengthEstimator(settings.length)
        self._rates = PrefillRateTracker(settings.advanced.prefill_rate_time_constant_s)
        self._store = ModelStore(settings.model_dir, settings.keep_versions) if settings.model_dir else None
        self._worker = worker or TrainingWorker(settings.worker)
        self._task: asyncio.Task[None] | None = None
        # prior latency slots (model.SLOTS order): the prior itself, and its p90 as a fixed multiple
        self._prior_scale = np.array(
            [1.0, settings.prior.ttft_p90_factor, 1.0, settings.prior.tpot_p90_factor], dtype=np.float64
        )

    def _state(self, pool: str) -> _PoolState:
        state = self._pools.get(pool)
        if state is None:  # a pool the predictor was not told about: default prior, still learns
            state = _PoolState(
                name=pool,
                prior=LatencyPrior.for_pool(self._pool_configs.get(pool), self.settings.prior),
                buffer=StratifiedBuffer(self.settings.advanced.buffer),
                accuracy={t: OnlineAccuracy(self.settings.accuracy_window) for t in Target},
                recent_ttft=RecentTtftCorrection(
                    self.settings.advanced.recent_ttft_window_s / self.settings.prior.time_scale,  # engine -> wall s
                    self.settings.advanced.recent_ttft_weight,
                ),
                recent=deque(maxlen=self.settings.export_samples),
            )
            self._pools[pool] = state
        return state

    # --- hot path -------------------------------------------------------------------------------

    def predict(
        self,
        pool: str,
        request: RequestShape,
        endpoints: Sequence[Endpoint],
        cached_tokens: Sequence[int],
        now_s: float | None = None,
        lower_cached_tokens: Sequence[int] | None = None,
    ) -> list[Prediction]:
        """Predictions for `request` on each endpoint, in order; one batched evaluation.

        `cached_tokens[i]`: the router's prefix-cache estimate on endpoint i; `lower_cached_tokens[i]`:
        of them, those below HBM (omitted: none). `now_s`: monotonic now (defaults to
        `time.monotonic()`), to age each endpoint's last relayed token.
        """
        if not endpoints:
            return []
        state = self._state(pool)
        rates = [self._rates.rate_tps(endpoint) for endpoint in endpoints]
        output_tokens = self._output_tokens(request)
        now = time.monotonic() if now_s is None else now_s
        rows = build_features(
            request.input_tokens, output_tokens, endpoints, cached_tokens, state.prior, rates, now, lower_cached_tokens
        )
        model = state.model  # read once: a swap during this call cannot mix two models
        latency = rows[:, _PRIOR_OF_SLOT].astype(np.float64) * self._prior_scale
        if model is not None:
            latency[:, model.slots] = model.latency_ms(rows)
        if state.p90_shift.any():
            latency[:, _P90_SLOTS] = np.maximum(latency[:, _P90_SLOTS] * state.p90_scale, latency[:, _MEAN_SLOTS])
        ttft_factor = state.recent_ttft.factor(now)
        if ttft_factor != 1.0:
            latency[:, _TTFT_SLOTS] *= ttft_factor
        ttft_source: PredictionSource = "prior"
        tpot_source: PredictionSource = "prior"
        version = 0
        if model is not None:
            version = model.version
            ttft_source = "model" if Target.TTFT in model.targets else "prior"
            tpot_source = "model" if Target.TPOT in model.targets else "prior"
        return [
            Prediction(
                endpoint_id=endpoint.id,
                ttft_ms=ttft,
                ttft_p90_ms=ttft_p90,
                tpot_ms=tpot,
                tpot_p90_ms=tpot_p90,
                ttft_source=ttft_source,
                tpot_source=tpot_source,
                features=rows[i],
                model_version=version,
                made_at_s=now,
                ttft_factor=ttft_factor,
            )
            for i, (endpoint, (ttft, ttft_p90, tpot, tpot_p90)) in enumerate(
                zip(endpoints, latency.tolist(), strict=True)
            )
        ]

    def _output_tokens(self, request: RequestShape) -> int:
        if request.output_tokens is not None:
            return request.output_tokens
        estimate = self.lengths.estimate(request.tenant, request.model)
        return estimate.p50_tokens if estimate is not None else self.settings.length.default_output_tokens

    def output_tokens_estimate(self, tenant: str, model: str) -> LengthEstimate | None:
        """This tenant's completion-length estimate for the model (None: no data). Not a reservation: a
        request without `max_tokens` reserves, and is limited to, the model's `default_max_tokens`."""
        return self.lengths.estimate(tenant, model)

    # --- learning -------------------------------------------------------------------------------

    def observe(
        self,
        pool: str,
        features: FloatArray,
        ttft_ms: float | None,
        tpot_ms: float | None,
        predicted: Prediction | None = None,
    ) -> None:
        """One served request: `features` as captured at routing time (`Prediction.features`), its
        observed TTFT and mean TPOT (None when not observed, e.g. a single-token completion), the
        prediction made before it ran."""
        if features.shape != (NUM_FEATURES,):
            raise ValueError(f"a feature row has {NUM_FEATURES} values, got shape {features.shape}")
        state = self._state(pool)
        if state.recent.maxlen:
            state.recent.append(_Outcome(time.monotonic(), features, ttft_ms, tpot_ms, predicted))
        if predicted is not None:
            for index, (target, actual) in enumerate(((Target.TTFT, ttft_ms), (Target.TPOT, tpot_ms))):
                if actual is not None:
                    state.accuracy[target].record(
                        predicted.mean_ms(target), predicted.p90_ms(target), actual, predicted.source_of(target)
                    )
                    self._adapt_p90(state, index, actual > predicted.p90_ms(target))
        if ttft_ms is None and tpot_ms is None:
            return
        state.buffer.add(features, ttft_ms, tpot_ms)
        state.new_samples += 1

    def observe_first_token(self, pool: str, predicted: Prediction, ttft_ms: float, now_s: float | None = None) -> None:
        """A streamed request's first token, `ttft_ms` after its dispatch, as soon as it is relayed:
        corrects the pool's next TTFT predictions (above). O(1)."""
        now = time.monotonic() if now_s is None else now_s
        self._state(pool).recent_ttft.add(now, ttft_ms, predicted.ttft_ms / predicted.ttft_factor)

    def _adapt_p90(self, state: _PoolState, index: int, missed: bool) -> None:
        """Adaptive conformal inference (Gibbs & Candes, 2021): after each outcome the p90's log
        shift moves up by rate x 0.9 on a miss and down by rate x 0.1 on a hit, so its long-run
        coverage is 90 % even as load drifts away from the data the model was trained on. O(1).
        A new model halves the shift (its held-out calibration already absorbed part of the drift);
        on the simulated fleet this keeps online coverage within 85-95 % where a reset or a full
        carry-over left it at 78 % or 97 % under heavy, drifting load. The rate (0.005) is a
        compromise with feedback that arrives late and in bunches: a request's TPOT is known only
        when it ends, and requests that decoded side by side miss together, so a fast rate swings
        the shift (replayed offline on the benchmark's outcomes, with the p90 floor of model.py:
        pooled TPOT coverage 86.7 % at 0.01, 88.2 % at 0.005; TTFT 89.5 and 89.2 %). Before the
        floor, 0.01 was needed: at 0.005 TTFT coverage at 90 % load was 76-81 % (tight SLO benchmark)."""
        rate = self.settings.advanced.p90_adaptation_rate
        if rate <= 0:
            return
        shift = float(state.p90_shift[index]) + rate * ((1.0 if missed else 0.0) - (1.0 - _P90_LEVEL))
        shift = min(max(shift, -_MAX_P90_SHIFT), _MAX_P90_SHIFT)
        state.p90_shift[index] = shift
        state.p90_scale[index] = math.exp(shift)

    def output_tokens_prediction(self, tenant: str, model: str, max_tokens: int | None = None) -> OutputPrediction:
        """One request's completion tokens, raw and corrected for the key's drift (prior.py)."""
        return self.lengths.predict(tenant, model, max_tokens)

    def observe_output(
        self, tenant: str, model: str, completion_tokens: int, predicted: OutputPrediction | None = None
    ) -> None:
        """A finished request's completion tokens, for output-length estimates (and, with the
        prediction made for it, their drift correction)."""
        self.lengths.observe(tenant, model, completion_tokens, predicted)

    def _due(self, state: _PoolState, now_s: float) -> bool:
        return (
            not state.training
            and state.new_samples >= self.settings.retrain_min_new_samples
            and state.buffer.train_count >= self.settings.min_samples
            and now_s - state.last_train_started_s >= self.settings.retrain_interval_s
        )

    async def retrain(self, pool: str) -> TrainOutcome | None:
        """Train `pool` now in the worker and swap in the result; None if training failed."""
        state = self._state(pool)
        async with state.lock:
            added = state.buffer.added
            train, heldout = state.buffer.snapshot()
            state.new_samples = 0
            state.last_train_started_s = time.monotonic()
            job = TrainJob(
                pool=pool,
                version=state.version + 1,
                train=train,
                heldout=heldout,
                incumbent=dict(state.model.targets) if state.model is not None else {},
                xgboost=self.settings.advanced.xgboost,
                min_samples=self.settings.min_samples,
                conformal_p90=self.settings.conformal_p90,
            )
            try:
                outcome = await self._worker.run(job)
            except Exception as exc:  # a failed training must not take the predictor down
                log.exception("predictor: training pool %s failed", pool)
                state.last_error = f"{type(exc).__name__}: {exc}"
                return None
            state.trainings += 1
            state.last_outcome = outcome
            state.last_error = None
            if outcome.model is not None:
                state.model = outcome.model  # the atomic swap
                state.version = outcome.model.version
                # the new model's held-out calibration already absorbed part of the drift
                state.p90_shift *= 0.5
                state.p90_scale[:] = np.exp(state.p90_shift)
                await self._save(state)
                await self._save_samples(state, (train, heldout, added))  # what it was trained on
            return outcome

    async def _save(self, state: _PoolState) -> None:
        """Save a model not saved yet (off the loop)."""
        model = state.model
        if self._store is None or model is None or state.saved_version == model.version:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._store.save, state.name, model, state.prior.id)
            state.saved_version = model.version
        except OSError:
            log.exception("predictor: saving pool %s model v%d failed", state.name, model.version)

    async def _save_samples(self, state: _PoolState, taken: tuple[Samples, Samples, int] | None = None) -> None:
        """Save the pool's samples (with each new model and at stop), so a restart keeps them;
        `taken` is a snapshot already made (training's) with the buffer's `added` count at the time.
        Nothing new since the last save: no write."""
        if taken is None:
            taken = (*state.buffer.snapshot(), state.buffer.added)  # copies, on the loop
        train, heldout, added = taken
        if self._store is None or added == state.samples_saved_at:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self._store.save_samples, state.name, train, heldout, state.prior.id
            )
            state.samples_saved_at = added
        except OSError:
            log.exception("predictor: saving pool %s samples failed", state.name)

    async def _training_loop(self) -> None:
        """Every `retrain_interval_s`, retrain each pool that gathered enough new samples."""
        while True:
            await asyncio.sleep(self.settings.retrain_interval_s)
            for state in list(self._pools.values()):
                if self._due(state, time.monotonic()):
                    try:
                        await self.retrain(state.name)
                    except Exception:  # the loop outlives any one pool's failure
                        log.exception("predictor: retraining pool %s failed", state.name)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load saved models (off the loop), start the worker and the retraining task."""
        if self._store is not None:
            loop = asyncio.get_running_loop()
            for state in list(self._pools.values()):
                model, latest = await loop.run_in_executor(None, self._load, state)
                state.version = max(state.version, latest)
                if model is not None:
                    state.model = model
                    state.saved_version = model.version
                    log.info("predictor: pool %s loaded model v%d", state.name, model.version)
                samples = await loop.run_in_executor(None, self._store.load_samples, state.name, state.prior.id)
                if samples is not None:
                    state.buffer.restore(*samples)
                    state.samples_saved_at = state.buffer.added
                    log.info("predictor: pool %s restored %d samples", state.name, len(samples[0]) + len(samples[1]))
        if self.settings.online_training:
            await self._worker.start()
            self._task = asyncio.create_task(self._training_loop(), name="predictor-training")

    def _load(self, state: _PoolState) -> tuple[PoolModel | None, int]:
        assert self._store is not None
        return self._store.load(state.name, state.prior.id), self._store.latest_version(state.name)

    async def stop(self) -> None:
        """Stop retraining (a running job finishes first), save unsaved models, stop the worker."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for state in self._pools.values():
            async with state.lock:
                await self._save(state)
                await self._save_samples(state)
        await self._worker.stop()

    # --- reporting ------------------------------------------------------------------------------

    def samples(self, pool: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """The recent outcomes per pool (oldest first): the feature row as routed, the observed and
        the predicted latency, the endpoint and when it was predicted and observed (monotonic s).

        Why: the buffers keep a stratified, unordered sample for training; judging a new feature or
        objective offline needs the outcomes in time order with what was predicted for them.
        """
        out: dict[str, list[dict[str, Any]]] = {}
        for name, state in self._pools.items():
            if pool is not None and name != pool:
                continue
            out[name] = [
                {
                    "observed_at_s": round(observed_s, 6),
                    "predicted_at_s": round(predicted.made_at_s, 6) if predicted is not None else None,
                    "endpoint": predicted.endpoint_id if predicted is not None else None,
                    "features": dict(zip(FEATURE_NAMES, np.asarray(features, dtype=np.float64).tolist(), strict=True)),
                    "ttft_ms": ttft_ms,
                    "tpot_ms": tpot_ms,
                    "predicted": None
                    if predicted is None
                    else {
                        "ttft_ms": predicted.ttft_ms,
                        "ttft_p90_ms": predicted.ttft_p90_ms,
                        "tpot_ms": predicted.tpot_ms,
                        "tpot_p90_ms": predicted.tpot_p90_ms,
                        "model_version": predicted.model_version,
                        "ttft_factor": predicted.ttft_factor,
                    },
                }
                for observed_s, features, ttft_ms, tpot_ms, predicted in list(state.recent)
            ]
        return out

    def status(self) -> dict[str, Any]:
        """Per pool and target: samples, online MAPE and p90 coverage, model age and source."""
        now_s = time.time()
        pools: dict[str, Any] = {}
        for name, state in self._pools.items():
            model = state.model
            targets: dict[str, Any] = {}
            for index, target in enumerate(Target):
                target_model = model.targets.get(target) if model is not None else None
                online = state.accuracy[target]
                targets[target.value] = {
                    "source": "model" if target_model is not None else "prior",
                    "samples": state.buffer.target_count(target),
                    "model_age_s": round(now_s - target_model.trained_at_s, 3) if target_model else None,
                    "train_samples": target_model.train_samples if target_model else 0,
                    "p90_offset": round(target_model.p90_offset, 4) if target_model else None,
                    "p90_floor": round(target_model.p90_floor, 4) if target_model else None,
                    "p90_online_shift": round(float(state.p90_shift[index]), 4),
                    "online": online.score().as_dict() | {"total": online.total},
                    "online_model": online.score("model").as_dict(),
                    "online_prior": online.score("prior").as_dict(),
                    "heldout": _score(target_model.heldout if target_model else None),
                    "prior_heldout": _score(target_model.prior_heldout if target_model else None),
                }
            outcome = state.last_outcome
            pools[name] = {
                "prior": state.prior.id,
                "model_version": model.version if model is not None else 0,
                "training": state.training,
                "trainings": state.trainings,
                "last_training": None
                if outcome is None
                else {
                    "duration_s": round(outcome.duration_s, 3),
                    "decisions": {t.value: d.value for t, d in outcome.decisions.items()},
                },
                "last_error": state.last_error,
                "ttft_recent_factor": round(state.recent_ttft.factor(time.monotonic()), 4),
                "buffer": {
                    "train_samples": state.buffer.train_count,
                    "heldout_samples": state.buffer.heldout_count,
                    "capacity": state.buffer.capacity,
                    "strata_used": sum(1 for c in state.buffer.strata_counts() if c),
                    "new_since_training": state.new_samples,
                },
                "targets": targets,
            }
        return {
            "enabled": self.settings.enabled,
            "online_training": self.settings.online_training,
            "worker": self._worker.kind,
            "pools": pools,
            "output_length": self.lengths.accuracy.status(),
        }


def _score(score: AccuracyScore | None) -> dict[str, Any] | None:
    return score.as_dict() if score is not None else None

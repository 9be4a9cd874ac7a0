"""What the predictor learns from and how well it predicts: the vocabulary (feature layout, request
shape, predictions, targets), the feature rows of one request on its candidates, the bounded training
samples those rows become, and the error of the predictions made from them.

One module because these are one data path: a row built at routing time (`build_features`) is the
sample stored (`StratifiedBuffer`), trained on and scored (`OnlineAccuracy`) unchanged, in the
layout `Feature` fixes.

Vocabulary
----------
Vocabulary of the predictor room: the feature layout, request shape, predictions and targets.

Features are one fixed-order float32 vector per (request, endpoint); `Feature` names the column of
each value, so a row captured at routing time can be stored, trained on and fed back unchanged. The
layout is part of the saved-model format: changing it bumps `FEATURES_VERSION`, and saved models
of another version are ignored at load (the prior takes over until the pool retrains).

Accuracy
--------
Prediction accuracy: the error math, and an online tracker over recent requests.

Online accuracy is honest by construction: it scores the prediction made at routing time, before
the request ran, against what the request then did. MAPE is the mean of |predicted - actual| /
actual over the window (in percent); p90 coverage is the share of requests whose actual value was at
or below the predicted p90 (a calibrated p90 covers 90 %).

Training samples
----------------
Bounded training samples per pool, stratified by load regime, with a held-out slice.

Why stratify: traffic is mostly calm, so a plain ring of recent samples forgets the overloaded
regimes the SLO gate cares most about. Samples are keyed by stratum (engine queue bucket x KV-usage
bucket x prefix-hit bucket, as in llm-d).

How this beats llm-d's fixed ring per stratum (500 each): there, a pool whose traffic sits in two
or three strata trains on 1,000-1,500 samples however much memory the other (empty) strata reserve.
Here all strata share one capacity: while there is room every sample is kept; once full, a new
sample evicts the oldest sample of the currently largest stratum. So a homogeneous pool uses the
whole buffer, a rare regime is never evicted until it is itself the largest, and every stratum keeps
its newest samples. Memory is bounded by `capacity` rows whatever the traffic.

A fixed share of samples goes to a held-out ring instead: the most recent ones, never trained on,
used to judge a new model against the one it would replace and to calibrate its p90. They are held
out in whole blocks of consecutive samples (`heldout_block`, default 100), not one by one: requests
that ran at the same time share their future (the arrivals that slowed them all), so a sample held
out between its neighbours is predicted from what they taught the model about that very future.
Sample by sample, the held-out TPOT MAPE read 4.9 % on the tight SLO benchmark; block by block
7-8 %. The online MAPE (predictions made before the request ran) is still higher (16-26 %), since
held-out blocks lie between training data while online prediction looks forward; /admin/predictor
shows both, and the online one is the measure to trust.

Storage is preallocated numpy; `add` is O(1) apart from one argmax over the per-stratum counts
(a few hundred integers) when the buffer is full. `snapshot` copies the filled rows for training.

Feature rows
------------
Feature rows for one request on each of its candidate endpoints, built in one pass.

One Python loop over the candidates reads each endpoint's stats and in-flight counters once, derives
the engineered values (uncached tokens, cached ratio, queued flag) and the prior, and appends the
row; one `np.array` call makes the float32 matrix. For the handful of candidates of a request, plain
float arithmetic is several times cheaper than numpy's per-call overhead. float32 is the dtype
XGBoost compares split thresholds in, so a stored row predicts exactly as it did at routing time.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from backends.types import Endpoint, InFlight, Role
from predictor.config import BufferSettings
from predictor.prior import LatencyPrior

FloatArray = npt.NDArray[np.float32]
Float64Array = npt.NDArray[np.float64]


class Feature(IntEnum):
    """Column index of each feature in a feature row (see `features.build_features`)."""

    INPUT_TOKENS = 0  # prompt tokens of the request
    CACHED_TOKENS = 1  # prompt tokens expected to hit this endpoint's prefix cache
    UNCACHED_TOKENS = 2  # input - cached: what this endpoint must prefill
    CACHED_RATIO = 3  # cached / input (llm-d's prefix score)
    OUTPUT_TOKENS = 4  # requested output (max_tokens) or the length estimate
    RUNNING = 5  # engine-reported running requests
    WAITING = 6  # engine-reported waiting requests
    QUEUED = 7  # 1.0 when the engine has a queue (waiting > 0)
    KV_USAGE_RATIO = 8  # engine-reported KV cache usage, 0..1
    INFLIGHT_REQUESTS = 9  # gateway's requests in flight on the endpoint
    INFLIGHT_PREFILL_TOKENS = 10  # gateway's uncached prompt tokens not yet prefilled there
    INFLIGHT_DECODE_TOKENS = 11  # gateway's context tokens of requests decoding there
    PREFILL_RATE_TPS = 12  # uncached prompt tokens/s the engine admitted recently (service.py)
    SINCE_LAST_TOKEN_MS = 13  # since the gateway last relayed a token from it; -1 unknown (features.py)
    ROLE = 14  # 0 both, 1 prefill, 2 decode
    BATCH_REQUESTS = 15  # decode batch the request would join, itself included
    BATCH_CONTEXT_TOKENS = 16  # KV context tokens of that batch, its own prompt included
    PREFILL_STEPS = 17  # chunked-prefill steps until its first token (prior's estimate)
    PRIOR_TTFT_MS = 18  # analytic prior (prior.py)
    PRIOR_TPOT_MS = 19
    # CACHED_TOKENS split by KV tier (docs/routing.md "KV-cache tiers"): a lower-tier hit is loaded over
    # PCIe, NVMe or the network before the prefill goes on, so it is not as fast as an HBM one
    CACHED_GPU_TOKENS = 20  # of them, expected in HBM
    CACHED_LOWER_TOKENS = 21  # of them, expected below HBM (host DRAM, disk, a remote or shared store)


NUM_FEATURES: Final = len(Feature)
FEATURE_NAMES: Final = tuple(f.name.lower() for f in Feature)
FEATURES_VERSION: Final = 2  # 2: the cached tokens per tier

_Z90: Final = 1.2815515655446004  # standard normal quantile at 0.9


class Target(StrEnum):
    """What is predicted: time to first token, and mean time per output token after the first."""

    TTFT = "ttft"
    TPOT = "tpot"


class Quantity(StrEnum):
    """The two regressors per target: the point estimate and the 90th percentile."""

    MEAN = "mean"
    P90 = "p90"


PredictionSource = Literal["prior", "model"]


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the predictor needs to know about a request (plain values, no policies types).

    `output_tokens` is the client's `max_tokens` when given; None lets the predictor use its
    output-length estimate for (tenant, model).
    """

    input_tokens: int
    output_tokens: int | None = None
    tenant: str = ""
    model: str = ""


@dataclass(slots=True, eq=False)
class Prediction:
    """Predicted latency of one request on one endpoint, in milliseconds. A value: never mutated
    (not frozen only because frozen dataclasses cost ~7x more to build, on the hot path).

    `source` says per target whether the analytic prior or a trained model produced it (a pool may
    have a TTFT model before it has enough multi-token requests for a TPOT one). `features` is the
    row the prediction was made from: hand it back to `LatencyPredictor.observe` with the outcome.
    """

    endpoint_id: str
    ttft_ms: float
    tpot_ms: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    ttft_source: PredictionSource
    tpot_source: PredictionSource
    features: FloatArray
    model_version: int = 0  # 0 = prior only
    made_at_s: float = 0.0  # monotonic time of the prediction (the dispatch)
    ttft_factor: float = 1.0  # the recent first tokens' correction applied to both TTFT values

    @property
    def source(self) -> PredictionSource:
        """ "model" when a trained model produced either target."""
        return "model" if "model" in (self.ttft_source, self.tpot_source) else "prior"

    def mean_ms(self, target: Target) -> float:
        return self.ttft_ms if target is Target.TTFT else self.tpot_ms

    def p90_ms(self, target: Target) -> float:
        return self.ttft_p90_ms if target is Target.TTFT else self.tpot_p90_ms

    def source_of(self, target: Target) -> PredictionSource:
        return self.ttft_source if target is Target.TTFT else self.tpot_source

    def within(self, target: Target, bound_ms: float) -> float:
        """Probability that the outcome is at most `bound_ms` (see `probability_within`)."""
        return probability_within(self.mean_ms(target), self.p90_ms(target), bound_ms)


def probability_within(median: float, p90: float, bound: float) -> float:
    """Probability that an outcome predicted as (median, p90) is at most `bound` (same unit).

    Reads the prediction as a log-normal through its point estimate (the median: the point model
    minimises absolute error on the log-ratio, model.py) and its p90. Both models learn the
    log-ratio over the prior, so log space is where their spread lives; a p90 at or under the
    median (no spread left) makes it a step at the median.
    """
    if bound <= 0.0:
        return 0.0
    if median <= 0.0:
        return 1.0
    if p90 <= median:
        return 1.0 if bound >= median else 0.0
    z = _Z90 * math.log(bound / median) / math.log(p90 / median)
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


ArrayLike = npt.ArrayLike


def absolute_percentage_errors(predicted: ArrayLike, actual: ArrayLike) -> npt.NDArray[np.float64]:
    """|predicted - actual| / actual per sample (a ratio; 0.1 = 10 %). Actuals must be > 0."""
    pred = np.asarray(predicted, dtype=np.float64)
    act = np.asarray(actual, dtype=np.float64)
    return np.abs(pred - act) / act


def mape_pct(predicted: ArrayLike, actual: ArrayLike) -> float:
    """Mean absolute percentage error in percent; NaN for no samples."""
    errors = absolute_percentage_errors(predicted, actual)
    return float(errors.mean() * 100.0) if errors.size else float("nan")


def p90_coverage(predicted_p90: ArrayLike, actual: ArrayLike) -> float:
    """Share (0..1) of samples at or below their predicted p90; NaN for no samples."""
    p90 = np.asarray(predicted_p90, dtype=np.float64)
    act = np.asarray(actual, dtype=np.float64)
    return float((act <= p90).mean()) if act.size else float("nan")


@dataclass(frozen=True, slots=True)
class AccuracyScore:
    samples: int
    mape_pct: float
    p90_coverage: float

    @classmethod
    def of(cls, predicted: ArrayLike, predicted_p90: ArrayLike, actual: ArrayLike) -> AccuracyScore:
        act = np.asarray(actual, dtype=np.float64)
        return cls(int(act.size), mape_pct(predicted, act), p90_coverage(predicted_p90, act))

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "samples": self.samples,
            "mape_pct": _finite_or_none(self.mape_pct),
            "p90_coverage": _finite_or_none(self.p90_coverage),
        }


class OnlineAccuracy:
    """Rolling accuracy of one (pool, target) over the last `window` predicted requests.

    `record` is O(1) (two writes into preallocated rings); `score` summarises on demand.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._ape = np.zeros(window)
        self._covered = np.zeros(window, dtype=bool)
        self._from_model = np.zeros(window, dtype=bool)
        self._next = 0
        self._held = 0
        self.total = 0  # predictions ever scored

    def record(self, predicted_ms: float, predicted_p90_ms: float, actual_ms: float, source: PredictionSource) -> None:
        if not actual_ms > 0:  # a zero or NaN observation has no percentage error
            return
        slot = self._next
        self._ape[slot] = abs(predicted_ms - actual_ms) / actual_ms
        self._covered[slot] = actual_ms <= predicted_p90_ms
        self._from_model[slot] = source == "model"
        self._next = (slot + 1) % self.window
        self._held = min(self._held + 1, self.window)
        self.total += 1

    def score(self, source: PredictionSource | None = None) -> AccuracyScore:
        """Over the window; `source` restricts it to predictions made by the prior or a model."""
        held = slice(0, self._held)
        ape, covered = self._ape[held], self._covered[held]
        if source is not None:
            chosen = self._from_model[held] if source == "model" else ~self._from_model[held]
            ape, covered = ape[chosen], covered[chosen]
        if not ape.size:
            return AccuracyScore(0, float("nan"), float("nan"))
        return AccuracyScore(int(ape.size), float(ape.mean() * 100.0), float(covered.mean()))


def _finite_or_none(value: float) -> float | None:
    return round(value, 4) if np.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class Samples:
    """Feature rows with their targets (NaN where a target was not observed)."""

    rows: FloatArray
    ttft_ms: Float64Array
    tpot_ms: Float64Array

    def __len__(self) -> int:
        return int(self.rows.shape[0])


class _Store:
    """Fixed-capacity sample storage addressed by slot."""

    def __init__(self, capacity: int) -> None:
        self.rows = np.zeros((capacity, NUM_FEATURES), dtype=np.float32)
        self.ttft_ms = np.full(capacity, np.nan)
        self.tpot_ms = np.full(capacity, np.nan)
        self.filled = np.zeros(capacity, dtype=bool)
        self.capacity = capacity
        self.held = 0  # slots filled

    def put(self, slot: int, row: FloatArray, ttft_ms: float, tpot_ms: float) -> None:
        self.rows[slot] = row
        self.ttft_ms[slot] = ttft_ms
        self.tpot_ms[slot] = tpot_ms
        if not self.filled[slot]:
            self.filled[slot] = True
            self.held += 1

    def count(self, target: Target) -> int:
        values = self.ttft_ms if target is Target.TTFT else self.tpot_ms
        return int(np.count_nonzero(self.filled & (values > 0)))

    def snapshot(self) -> Samples:
        mask = self.filled
        return Samples(self.rows[mask].copy(), self.ttft_ms[mask].copy(), self.tpot_ms[mask].copy())


class StratifiedBuffer:
    """Training samples in one shared capacity, evicted stratum-fairly; plus a held-out ring."""

    def __init__(self, settings: BufferSettings) -> None:
        self.settings = settings
        self._waiting_edges = list(settings.waiting_edges)
        self._kv_buckets = settings.kv_buckets
        self._prefix_buckets = settings.prefix_buckets
        self.num_strata = (len(self._waiting_edges) + 1) * self._kv_buckets * self._prefix_buckets
        self._train = _Store(settings.capacity)
        self._next_free = 0  # slots below this have been used at least once
        self._slots: list[deque[int]] = [deque() for _ in range(self.num_strata)]  # oldest first
        self._sizes = np.zeros(self.num_strata, dtype=np.int64)
        self._heldout = _Store(settings.heldout_capacity)
        self._heldout_next = 0
        # one block in `period` is held out, the second of each period (so a young buffer has some)
        self._period = round(1 / settings.heldout_fraction) if settings.heldout_fraction > 0 else 0
        self.added = 0  # samples ever added (training and held-out)

    def stratum(self, row: FloatArray) -> int:
        """Index of the load regime a row belongs to."""
        waiting = bisect_right(self._waiting_edges, float(row[Feature.WAITING]))
        kv = min(int(float(row[Feature.KV_USAGE_RATIO]) * self._kv_buckets), self._kv_buckets - 1)
        prefix = min(int(float(row[Feature.CACHED_RATIO]) * self._prefix_buckets), self._prefix_buckets - 1)
        return (waiting * self._kv_buckets + max(kv, 0)) * self._prefix_buckets + max(prefix, 0)

    def is_heldout(self, index: int) -> bool:
        """Whether the sample added `index`-th (from 0) belongs to a held-out block."""
        return self._period > 0 and (index // self.settings.heldout_block) % self._period == 1

    def add(self, row: FloatArray, ttft_ms: float | None, tpot_ms: float | None) -> bool:
        """Store one sample; returns True when it went to the held-out slice."""
        ttft = np.nan if ttft_ms is None else ttft_ms
        tpot = np.nan if tpot_ms is None else tpot_ms
        held = self.is_heldout(self.added)
        self.added += 1
        if held:
            self._put_heldout(row, ttft, tpot)
        else:
            self._put_train(row, ttft, tpot)
        return held

    def _put_heldout(self, row: FloatArray, ttft: float, tpot: float) -> None:
        self._heldout.put(self._heldout_next, row, ttft, tpot)
        self._heldout_next = (self._heldout_next + 1) % self._heldout.capacity

    def _put_train(self, row: FloatArray, ttft: float, tpot: float) -> None:
        if self._next_free < self._train.capacity:
            slot = self._next_free
            self._next_free += 1
        else:  # full: the largest stratum gives up its oldest sample
            largest = int(self._sizes.argmax())
            slot = self._slots[largest].popleft()
            self._sizes[largest] -= 1
        stratum = self.stratum(row)
        self._slots[stratum].append(slot)
        self._sizes[stratum] += 1
        self._train.put(slot, row, ttft, tpot)

    @property
    def train_count(self) -> int:
        return self._train.held

    @property
    def heldout_count(self) -> int:
        return self._heldout.held

    @property
    def capacity(self) -> int:
        return self._train.capacity + self._heldout.capacity

    def target_count(self, target: Target) -> int:
        """Samples (training and held-out) with an observed value of `target`."""
        return self._train.count(target) + self._heldout.count(target)

    def strata_counts(self) -> list[int]:
        """Training samples held per stratum (for status and tests)."""
        return [int(c) for c in self._sizes]

    def restore(self, train: Samples, heldout: Samples) -> None:
        """Put saved samples back (a restart): training rows through the stratified path (a smaller
        buffer keeps the newest of each stratum), held-out rows into the held-out ring; the block
        count carries on after them."""
        for row, ttft, tpot in zip(train.rows, train.ttft_ms.tolist(), train.tpot_ms.tolist(), strict=True):
            self._put_train(row, ttft, tpot)
        for row, ttft, tpot in zip(heldout.rows, heldout.ttft_ms.tolist(), heldout.tpot_ms.tolist(), strict=True):
            self._put_heldout(row, ttft, tpot)
        self.added += len(train) + len(heldout)

    def snapshot(self) -> tuple[Samples, Samples]:
        """Copies of (training, held-out) samples, safe to hand to a worker."""
        return self._train.snapshot(), self._heldout.snapshot()


ROLE_CODE = {Role.BOTH: 0.0, Role.PREFILL: 1.0, Role.DECODE: 2.0}
_SINCE_LAST_TOKEN_CAP_MS = 60_000.0


def _last_token_s(inflight: InFlight) -> float:
    """Monotonic time the gateway last relayed a token (a streamed chunk, a first token) from the
    endpoint, 0 when unknown.

    Why: a running engine emits a token for every request at the end of every step, so the time
    since the last one says whether the engine is mid-step (and how far in) or idle, at a resolution
    no metrics scrape has; on the simulated fleet it halves TTFT error. The gateway's relay sets it on
    every streamed batch of output; endpoints that never streamed read "unknown" (-1).
    """
    return inflight.last_token_s


def build_features(
    input_tokens: int,
    output_tokens: int,
    endpoints: Sequence[Endpoint],
    cached_tokens: Sequence[int],
    prior: LatencyPrior,
    prefill_rates_tps: Sequence[float] | None = None,
    now_s: float = 0.0,
    lower_cached_tokens: Sequence[int] | None = None,
) -> FloatArray:
    """Rows (len(endpoints) x NUM_FEATURES, float32), one per endpoint, columns in `Feature` order.

    `cached_tokens[i]` is the router's estimate of the prompt tokens already in endpoint i's prefix
    cache; it is clipped to [0, input_tokens]. `prefill_rates_tps[i]` is endpoint i's recent
    uncached prompt tokens per second (service.py; 0 when omitted). `now_s` (monotonic) dates the
    last token the gateway relayed from each endpoint (`SINCE_LAST_TOKEN_MS`, see `_last_token_s`).
    `lower_cached_tokens[i]`: of endpoint i's cached tokens, those expected below HBM (clipped to the
    cached ones; omitted: all in HBM, the index before tiers), so the model tells a DRAM hit from an
    HBM one (`CACHED_GPU_TOKENS`, `CACHED_LOWER_TOKENS`).
    Negative counters (an accounting bug upstream) are read as 0 so they never reach the model.
    """
    if len(endpoints) != len(cached_tokens):
        raise ValueError(f"{len(endpoints)} endpoints but {len(cached_tokens)} cached-token estimates")
    rates = prefill_rates_tps if prefill_rates_tps is not None else [0.0] * len(endpoints)
    lowers = lower_cached_tokens if lower_cached_tokens is not None else [0] * len(endpoints)
    inputs = float(max(input_tokens, 0))
    outputs = float(max(output_tokens, 1))
    estimate = prior.estimate
    rows: list[tuple[float, ...]] = []
    for endpoint, cached_estimate, rate_tps, lower_estimate in zip(
        endpoints, cached_tokens, rates, lowers, strict=True
    ):
        stats = endpoint.stats
        inflight = endpoint.inflight
        cached = float(cached_estimate) if cached_estimate > 0 else 0.0
        if cached > inputs:
            cached = inputs
        lower = float(lower_estimate) if lower_estimate > 0 else 0.0
        if lower > cached:
            lower = cached
        running = float(stats.running) if stats.running > 0 else 0.0
        waiting = float(stats.waiting) if stats.waiting > 0 else 0.0
        kv_usage = stats.kv_usage_ratio if stats.kv_usage_ratio > 0 else 0.0
        requests = float(inflight.requests) if inflight.requests > 0 else 0.0
        prefill = float(inflight.prefill_tokens) if inflight.prefill_tokens > 0 else 0.0
        decode = float(inflight.decode_tokens) if inflight.decode_tokens > 0 else 0.0
        rate = float(rate_tps) if rate_tps > 0 else 0.0
        last_token_s = _last_token_s(inflight)
        since_ms = min((now_s - last_token_s) * 1e3, _SINCE_LAST_TOKEN_CAP_MS) if 0 < last_token_s <= now_s else -1.0
        p = estimate(inputs, cached, outputs, running, waiting, requests, prefill, decode, rate, since_ms)
        rows.append(
            (
                inputs,
                cached,
                inputs - cached,
                cached / inputs if inputs else 0.0,
                outputs,
                running,
                waiting,
                1.0 if waiting > 0 else 0.0,
                kv_usage if kv_usage < 1.0 else 1.0,
                requests,
                prefill,
                decode,
                rate,
                since_ms,
                ROLE_CODE[endpoint.role],
                p.batch_requests,
                p.batch_context_tokens,
                p.prefill_steps,
                p.ttft_ms,
                p.tpot_ms,
                cached - lower,
                lower,
            )
        )
    return np.array(rows, dtype=np.float32).reshape(len(rows), NUM_FEATURES)

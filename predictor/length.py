"""Output-length estimates per (tenant, model), learnt from the completions the gateway served.

Used when a request has no `max_tokens`: admission reserves the p90 (few requests overrun it, so
token buckets are rarely reconciled upward), the latency predictor uses the median.

Each (tenant, model) keeps an exponentially decayed histogram of completion lengths over log-spaced
buckets (4 per doubling, ±9 % resolution, 1 to 2**20 tokens): O(1) memory per key, O(1) update
(one multiply by a decay factor is lazily folded into a growing weight), quantiles by one cumulative
sum. The weight of a sample halves every `half_life_samples` newer samples of the same key, so
estimates follow a tenant whose usage changes. Keys live in an LRU bounded by `max_keys`. A key with
too few samples falls back to the model-wide estimate (every tenant's completions of that model).

Drift correction (DriftSched: Palaniappan, arXiv 2606.02982, corrects admission-time estimates online
by their recent bias against observed completions). The histogram is deliberately slow (hundreds of
samples per half-life), so when a tenant's outputs change, or a new tenant borrows the model-wide
estimate, its median is wrong for a long while, and always in the same direction. `predict` therefore
multiplies the median by exp(bias), where the bias is an exponential moving average (rate
`drift_rate`) of log(observed / median) over the key's recent completions, kept within
[1/`drift_max_factor`, `drift_max_factor`]. Completions that stopped at their own `max_tokens` say
only "at least that many" and are not learnt from. `LengthAccuracy` keeps the mean absolute error of
the raw and the corrected predictions, so the correction's worth is measured, not assumed.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from predictor.config import LengthSettings

_BUCKETS_PER_DOUBLING = 4
_MAX_DOUBLINGS = 20
_NUM_BUCKETS = _BUCKETS_PER_DOUBLING * _MAX_DOUBLINGS + 1
# bucket b holds lengths in [2**((b-0.5)/4), 2**((b+0.5)/4)); its representative value is 2**(b/4)
_BUCKET_VALUE = 2.0 ** (np.arange(_NUM_BUCKETS) / _BUCKETS_PER_DOUBLING)
_BUCKET_VALUES: list[float] = _BUCKET_VALUE.tolist()  # the same doubles, read without numpy scalars
_RENORMALISE_ABOVE = 1e100
_ALL_TENANTS = "*"
_MAX_PREDICTED = 256


@dataclass(frozen=True, slots=True)
class OutputPrediction:
    """One request's predicted completion tokens: `raw_tokens` the histogram's median, `tokens` after
    the drift correction (both within the request's max_tokens); `uncapped_raw` before the cap (what
    the drift is learnt against); `max_tokens` the request's own limit, if any."""

    raw_tokens: float
    tokens: float
    uncapped_raw: float
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class LengthEstimate:
    """Estimated completion tokens of the next request; `samples` is the effective (decayed) count."""

    mean_tokens: float
    p50_tokens: int
    p90_tokens: int
    samples: float


class _DecayedHistogram:
    def __init__(self, decay: float) -> None:
        self._growth = 1.0 / decay  # new samples weigh growth**n instead of decaying all old ones
        self._weight = 1.0
        # a list, not a numpy array: `add` (twice per request) updates one bucket and the quantiles
        # take one running sum (`accumulate`, in C) and a bisection; per call, numpy's overhead on 81
        # buckets was most of the cost. Same doubles, same order of additions as np.cumsum.
        self._counts: list[float] = [0.0] * _NUM_BUCKETS
        self._sum_tokens = 0.0
        self._sum_weight = 0.0
        self.observed = 0
        # asked on every request (the gate's prediction), changed only by `add`: kept until then
        self._estimate: LengthEstimate | None = None

    def add(self, tokens: int) -> None:
        self._estimate = None
        bucket = min(_NUM_BUCKETS - 1, max(0, round(math.log2(max(tokens, 1)) * _BUCKETS_PER_DOUBLING)))
        self._weight *= self._growth
        if self._weight > _RENORMALISE_ABOVE:
            weight = self._weight
            self._counts = [count / weight for count in self._counts]
            self._sum_tokens /= self._weight
            self._sum_weight /= self._weight
            self._weight = 1.0
        self._counts[bucket] += self._weight
        self._sum_tokens += self._weight * tokens
        self._sum_weight += self._weight
        self.observed += 1

    @property
    def effective_samples(self) -> float:
        """Sum of sample weights relative to the newest sample's weight."""
        return self._sum_weight / self._weight

    def quantile(self, q: float) -> int:
        cumulative = list(accumulate(self._counts))
        bucket = bisect_left(cumulative, q * cumulative[-1])  # np.searchsorted's side="left"
        return max(1, round(_BUCKET_VALUES[min(bucket, _NUM_BUCKETS - 1)]))

    def estimate(self) -> LengthEstimate:
        if self._estimate is None:
            # both quantiles from one cumulative sum
            cumulative = list(accumulate(self._counts))
            total = cumulative[-1]
            p50, p90 = bisect_left(cumulative, 0.5 * total), bisect_left(cumulative, 0.9 * total)
            self._estimate = LengthEstimate(
                mean_tokens=self._sum_tokens / self._sum_weight,
                p50_tokens=max(1, round(_BUCKET_VALUES[min(p50, _NUM_BUCKETS - 1)])),
                p90_tokens=max(1, round(_BUCKET_VALUES[min(p90, _NUM_BUCKETS - 1)])),
                samples=self.effective_samples,
            )
        return self._estimate


class LengthAccuracy:
    """Mean absolute error (tokens) of the raw and the drift-corrected predictions."""

    __slots__ = ("abs_error_corrected", "abs_error_raw", "samples")

    def __init__(self) -> None:
        self.samples = 0
        self.abs_error_raw = 0.0
        self.abs_error_corrected = 0.0

    def record(self, predicted: OutputPrediction, observed: int) -> None:
        self.samples += 1
        self.abs_error_raw += abs(observed - predicted.raw_tokens)
        self.abs_error_corrected += abs(observed - predicted.tokens)

    def status(self) -> dict[str, float | int | None]:
        n = self.samples
        return {
            "samples": n,
            "mae_raw_tokens": round(self.abs_error_raw / n, 2) if n else None,
            "mae_corrected_tokens": round(self.abs_error_corrected / n, 2) if n else None,
        }


class OutputLengthEstimator:
    """Completion-length estimates per (tenant, model), bounded in memory (module docstring)."""

    def __init__(self, settings: LengthSettings) -> None:
        self.settings = settings
        self._decay = 0.5 ** (1.0 / settings.half_life_samples)
        self._keys: OrderedDict[tuple[str, str], _DecayedHistogram] = OrderedDict()
        self._bias: OrderedDict[tuple[str, str], float] = OrderedDict()  # EMA of log(observed / median)
        self._max_log = math.log(settings.drift_max_factor)
        self.accuracy = LengthAccuracy()
        # predictions made since the last `observe` (which may change any of them): the requests
        # admitted between two finished ones ask the same; bounded, since `max_tokens` comes from
        # the client
        self._predicted: dict[tuple[str, str, int | None], OutputPrediction] = {}

    def predict(self, tenant: str, model: str, max_tokens: int | None = None) -> OutputPrediction:
        """The request's completion tokens: the median (else `default_output_tokens`), corrected for
        the key's drift, within `max_tokens`."""
        memo = (tenant, model, max_tokens)
        made = self._predicted.get(memo)
        if made is not None:
            return made
        estimate = self.estimate(tenant, model)
        raw = float(estimate.p50_tokens if estimate is not None else self.settings.default_output_tokens)
        corrected = raw * math.exp(self._bias.get((tenant, model), 0.0))
        if max_tokens is not None:
            made = OutputPrediction(min(raw, max_tokens), min(corrected, max_tokens), raw, max_tokens)
        else:
            made = OutputPrediction(raw, corrected, raw)
        if len(self._predicted) >= _MAX_PREDICTED:
            self._predicted.clear()
        self._predicted[memo] = made
        return made

    def observe(
        self, tenant: str, model: str, completion_tokens: int, predicted: OutputPrediction | None = None
    ) -> None:
        """Record one finished request's completion tokens (skip requests that were cut short);
        with the prediction made for it, learn the drift and score both predictions."""
        if completion_tokens < 0:
            return
        self._predicted.clear()
        if predicted is not None:
            self.accuracy.record(predicted, completion_tokens)
            self._learn_drift((tenant, model), predicted, completion_tokens)
        for key in ((tenant, model), (_ALL_TENANTS, model)):
            histogram = self._keys.get(key)
            if histogram is None:
                histogram = self._keys[key] = _DecayedHistogram(self._decay)
                while len(self._keys) > self.settings.max_keys:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
            histogram.add(completion_tokens)

    def _learn_drift(self, key: tuple[str, str], predicted: OutputPrediction, observed: int) -> None:
        rate = self.settings.drift_rate
        if rate <= 0 or (predicted.max_tokens is not None and observed >= predicted.max_tokens):
            return  # off, or stopped by its own limit: it says only "at least that many"
        error = math.log(max(observed, 1) / max(predicted.uncapped_raw, 1.0))
        bias = self._bias.pop(key, 0.0)
        bias += rate * (error - bias)
        self._bias[key] = min(max(bias, -self._max_log), self._max_log)
        while len(self._bias) > self.settings.max_keys:
            self._bias.popitem(last=False)

    def drift_factor(self, tenant: str, model: str) -> float:
        """The correction `predict` applies to this key's median now."""
        return math.exp(self._bias.get((tenant, model), 0.0))

    def estimate(self, tenant: str, model: str) -> LengthEstimate | None:
        """The tenant's estimate, else the model-wide one, else None (fewer than `min_samples`)."""
        for key in ((tenant, model), (_ALL_TENANTS, model)):
            histogram = self._keys.get(key)
            if histogram is not None and histogram.observed >= self.settings.min_samples:
                return histogram.estimate()
        return None

    def __len__(self) -> int:
        return len(self._keys)

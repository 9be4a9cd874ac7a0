"""Output-length estimates per (tenant, model), learnt from the completions the gateway served.

Used when a request has no `max_tokens`: admission reserves the p90 (few requests overrun it, so
token buckets are rarely reconciled upward), the latency predictor uses the median.

Each (tenant, model) keeps an exponentially decayed histogram of completion lengths over log-spaced
buckets (4 per doubling, ±9 % resolution, 1 to 2**20 tokens): O(1) memory per key, O(1) update
(one multiply by a decay factor is lazily folded into a growing weight), quantiles by one cumulative
sum. The weight of a sample halves every `half_life_samples` newer samples of the same key, so
estimates follow a tenant whose usage changes. Keys live in an LRU bounded by `max_keys`. A key with
too few samples falls back to the model-wide estimate (every tenant's completions of that model).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from predictor.config import LengthSettings

_BUCKETS_PER_DOUBLING = 4
_MAX_DOUBLINGS = 20
_NUM_BUCKETS = _BUCKETS_PER_DOUBLING * _MAX_DOUBLINGS + 1
# bucket b holds lengths in [2**((b-0.5)/4), 2**((b+0.5)/4)); its representative value is 2**(b/4)
_BUCKET_VALUE = 2.0 ** (np.arange(_NUM_BUCKETS) / _BUCKETS_PER_DOUBLING)
_RENORMALISE_ABOVE = 1e100
_ALL_TENANTS = "*"


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
        self._counts = np.zeros(_NUM_BUCKETS)
        self._sum_tokens = 0.0
        self._sum_weight = 0.0
        self.observed = 0

    def add(self, tokens: int) -> None:
        bucket = min(_NUM_BUCKETS - 1, max(0, round(math.log2(max(tokens, 1)) * _BUCKETS_PER_DOUBLING)))
        self._weight *= self._growth
        if self._weight > _RENORMALISE_ABOVE:
            self._counts /= self._weight
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
        cumulative = np.cumsum(self._counts)
        bucket = int(np.searchsorted(cumulative, q * cumulative[-1]))
        return max(1, round(float(_BUCKET_VALUE[min(bucket, _NUM_BUCKETS - 1)])))

    def estimate(self) -> LengthEstimate:
        return LengthEstimate(
            mean_tokens=self._sum_tokens / self._sum_weight,
            p50_tokens=self.quantile(0.5),
            p90_tokens=self.quantile(0.9),
            samples=self.effective_samples,
        )


class OutputLengthEstimator:
    """Completion-length estimates per (tenant, model), bounded in memory (module docstring)."""

    def __init__(self, settings: LengthSettings) -> None:
        self.settings = settings
        self._decay = 0.5 ** (1.0 / settings.half_life_samples)
        self._keys: OrderedDict[tuple[str, str], _DecayedHistogram] = OrderedDict()

    def observe(self, tenant: str, model: str, completion_tokens: int) -> None:
        """Record one finished request's completion tokens (skip requests that were cut short)."""
        if completion_tokens < 0:
            return
        for key in ((tenant, model), (_ALL_TENANTS, model)):
            histogram = self._keys.get(key)
            if histogram is None:
                histogram = self._keys[key] = _DecayedHistogram(self._decay)
                while len(self._keys) > self.settings.max_keys:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
            histogram.add(completion_tokens)

    def estimate(self, tenant: str, model: str) -> LengthEstimate | None:
        """The tenant's estimate, else the model-wide one, else None (fewer than `min_samples`)."""
        for key in ((tenant, model), (_ALL_TENANTS, model)):
            histogram = self._keys.get(key)
            if histogram is not None and histogram.observed >= self.settings.min_samples:
                return histogram.estimate()
        return None

    def __len__(self) -> int:
        return len(self._keys)

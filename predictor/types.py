"""Vocabulary of the predictor room: the feature layout, request shape, predictions and targets.

Features are one fixed-order float32 vector per (request, endpoint); `Feature` names the column of
each value, so a row captured at routing time can be stored, trained on and fed back unchanged. The
layout is part of the saved-model format: changing it bumps `FEATURES_VERSION`, and saved models
of another version are ignored at load (the prior takes over until the pool retrains).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

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
    PREFILL_RATE_TPS = 12  # uncached prompt tokens/s the engine admitted recently (recent.py)
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

"""Feature rows for one request on each of its candidate endpoints, built in one pass.

One Python loop over the candidates reads each endpoint's stats and in-flight counters once, derives
the engineered values (uncached tokens, cached ratio, queued flag) and the prior, and appends the
row; one `np.array` call makes the float32 matrix. For the handful of candidates of a request, plain
float arithmetic is several times cheaper than numpy's per-call overhead. float32 is the dtype
XGBoost compares split thresholds in, so a stored row predicts exactly as it did at routing time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backends.types import Endpoint, InFlight, Role
from predictor.prior import LatencyPrior
from predictor.types import NUM_FEATURES, FloatArray

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
    uncached prompt tokens per second (recent.py; 0 when omitted). `now_s` (monotonic) dates the
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

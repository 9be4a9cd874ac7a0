"""Self-contained synthetic traffic for predictor tests: endpoints, requests, and a hidden truth.

The truth is the analytic prior times a load-dependent factor the prior does not know (KV pressure
and queueing slow TTFT; KV pressure and pending prefill slow TPOT) times log-normal noise, so a
model must learn something real, and its floor is known (noise sigma 0.08 TTFT, 0.03 TPOT).
"""

from __future__ import annotations

import math

import numpy as np

from backends.config import PoolConfig
from backends.types import Endpoint, EndpointState, EndpointStats, InFlight, Role
from predictor.config import PredictorSettings, PriorSettings
from predictor.features import Feature, FloatArray, RequestShape, Samples, build_features
from predictor.prior import LatencyPrior

POOL = "p"
PRESET = "llama-3.1-8b@h100"
TTFT_NOISE_SIGMA = 0.08
TPOT_NOISE_SIGMA = 0.03


def pool_config(name: str = POOL, preset: str | None = PRESET) -> PoolConfig:
    return PoolConfig(name=name, model="m", replicas=1, preset=preset)


def prior(preset: str | None = PRESET) -> LatencyPrior:
    return LatencyPrior.for_pool(pool_config(preset=preset), PriorSettings())


def endpoint(
    index: int = 0,
    *,
    running: int = 0,
    waiting: int = 0,
    kv: float = 0.0,
    requests: int | None = None,
    prefill_tokens: int = 0,
    decode_tokens: int = 0,
    role: Role = Role.BOTH,
    pool: str = POOL,
) -> Endpoint:
    return Endpoint(
        id=f"{pool}/{role.value}-{index}",
        pool=pool,
        base_url=f"http://127.0.0.1:{9000 + index}",
        engine="sim",
        served_model="m",
        role=role,
        state=EndpointState.READY,
        stats=EndpointStats(running=running, waiting=waiting, kv_usage_ratio=kv, scraped_at_s=1.0),
        inflight=InFlight(
            requests=running + waiting if requests is None else requests,
            prefill_tokens=prefill_tokens,
            decode_tokens=decode_tokens,
        ),
    )


def random_endpoint(rng: np.random.Generator, index: int = 0) -> Endpoint:
    running = int(rng.integers(0, 64))
    waiting = int(rng.poisson(2.0)) if rng.random() < 0.4 else 0
    return endpoint(
        index,
        running=running,
        waiting=waiting,
        kv=float(min(1.0, running / 64 * rng.uniform(0.5, 1.3))),
        prefill_tokens=int(waiting * rng.integers(200, 3000)),
        decode_tokens=int(running * rng.integers(300, 2500)),
    )


def random_request(rng: np.random.Generator) -> RequestShape:
    return RequestShape(input_tokens=int(rng.integers(50, 6000)), output_tokens=int(rng.integers(10, 800)))


def random_cached(rng: np.random.Generator, request: RequestShape) -> int:
    return int(rng.integers(0, request.input_tokens)) if rng.random() < 0.5 else 0


def truth(row: FloatArray, rng: np.random.Generator) -> tuple[float, float]:
    """(ttft_ms, tpot_ms) the synthetic world produces for a feature row."""
    kv = float(row[Feature.KV_USAGE_RATIO])
    waiting = float(row[Feature.WAITING])
    pending = float(row[Feature.INFLIGHT_PREFILL_TOKENS])
    ttft = row[Feature.PRIOR_TTFT_MS] * math.exp(
        0.8 * kv**2 + 0.15 * min(waiting, 5.0) + rng.normal(0.0, TTFT_NOISE_SIGMA)
    )
    tpot = row[Feature.PRIOR_TPOT_MS] * (1 + 0.4 * kv + 3e-5 * pending) * math.exp(rng.normal(0.0, TPOT_NOISE_SIGMA))
    return float(ttft), float(tpot)


def samples(n: int, rng: np.random.Generator, *, scale: float = 1.0, preset: str | None = PRESET) -> Samples:
    """`n` synthetic samples; `scale` multiplies the true latencies (a world the prior misjudges)."""
    latency_prior = prior(preset)
    rows = []
    for _ in range(n):
        request = random_request(rng)
        rows.append(
            build_features(
                request.input_tokens,
                request.output_tokens or 1,
                [random_endpoint(rng)],
                [random_cached(rng, request)],
                latency_prior,
            )[0]
        )
    matrix = np.stack(rows)
    outcomes = np.array([truth(row, rng) for row in matrix]) * scale
    return Samples(matrix, outcomes[:, 0].copy(), outcomes[:, 1].copy())


def settings(**overrides: object) -> PredictorSettings:
    """Small, fast settings for tests: thread worker, low thresholds."""
    base: dict[str, object] = {
        "worker": "thread",
        "min_samples": 200,
        "retrain_min_new_samples": 200,
        "retrain_interval_s": 0.01,
    }
    base.update(overrides)
    return PredictorSettings.model_validate(base)

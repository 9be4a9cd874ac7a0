"""Is a pool saturated: could any of its endpoints start one more request now?

Work-conserving: a request waits in the gateway only while *no* endpoint could start it now. One
endpoint cannot when any of these holds (each limit optional):

- the engine's waiting queue is over `max_engine_waiting`. The engine's own count is scraped (and
  lags); the gateway's in-flight count on the endpoint is exact but only its own, so the queue is
  taken as the larger of the scraped `waiting` and what the in-flight requests, this one included,
  would leave over the engine's batch size (`max_num_seqs`, when the pool states it): with
  `max_engine_waiting: 0` a request goes only while the batch has a free slot;
- the engine's KV-cache usage is over `max_kv_usage_ratio`;
- the gateway's own in-flight requests there reach `max_inflight`;
- the request's predicted TTFT there is over `max_predicted_ttft_ms` (the pool's threshold; the
  request's own objective is the SLO gate's business).

These are the Gateway API Inference Extension's saturation signals (queue depth, KV utilisation;
its defaults are 5 and 0.8, `pkg/epp/saturationdetector/config.go`). Stale engine metrics are not
read: with no fresh scrape only the gateway's own in-flight count speaks, so a pool whose engines
export no metrics is never held up by numbers it does not have.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from backends.types import Endpoint
from policies.flow.reserve import ReserveSize

REASON_ENGINE_QUEUE: Final = "engine_queue"
REASON_KV_USAGE: Final = "kv_usage"
REASON_INFLIGHT: Final = "inflight"
REASON_PREDICTED_TTFT: Final = "predicted_ttft"


@dataclass(frozen=True, slots=True)
class SaturationLimits:
    """A pool's limits (None: not checked). `max_num_seqs` is the engine's batch size, when known;
    `reserve_slots` free slots (up to `reserve_max_slots`, sized from recent demand) are kept for
    tenants under their share (`reserve.py`)."""

    max_engine_waiting: int | None = 5
    max_kv_usage_ratio: float | None = 0.8
    max_inflight: int | None = None
    max_predicted_ttft_ms: float | None = None
    max_stats_age_s: float = 2.0
    reserve_slots: int = 0  # policies.flow.reserve
    max_num_seqs: int | None = None
    reserve_max_slots: int | None = None  # above reserve_slots: sized from recent demand
    reserve_margin: int = 1
    reserve_avoid_prefills: bool = True
    preempt: bool = False  # policies.flow.preempt
    reserve_clear_lane: bool = False  # policies.flow.reserve.clear_lane
    program_reserve_slots: int = 0  # policies.flow.program_reserve: per endpoint, inside a tenant

    @property
    def reserve(self) -> ReserveSize:
        return ReserveSize(self.reserve_slots, self.reserve_max_slots, self.reserve_margin)


def engine_waiting(endpoint: Endpoint, limits: SaturationLimits, now_s: float) -> int:
    """Requests the engine would hold unstarted with one more: the scraped queue, or what the
    gateway's own in-flight requests and this one leave over the batch size."""
    implied = endpoint.inflight.requests + 1 - limits.max_num_seqs if limits.max_num_seqs else 0
    if endpoint.stats_age_s(now_s) > limits.max_stats_age_s:
        return max(implied, 0)
    return max(endpoint.engine_waiting(), implied, 0)


def endpoint_saturation(
    endpoint: Endpoint, limits: SaturationLimits, now_s: float, predicted_ttft_ms: float | None = None
) -> str | None:
    """Why `endpoint` cannot start one more request now (a reason label), or None when it can."""
    if limits.max_inflight is not None and endpoint.inflight.requests >= limits.max_inflight:
        return REASON_INFLIGHT
    if limits.max_engine_waiting is not None and engine_waiting(endpoint, limits, now_s) > limits.max_engine_waiting:
        return REASON_ENGINE_QUEUE
    fresh = endpoint.stats_age_s(now_s) <= limits.max_stats_age_s
    if fresh and limits.max_kv_usage_ratio is not None and endpoint.stats.kv_usage_ratio > limits.max_kv_usage_ratio:
        return REASON_KV_USAGE
    threshold = limits.max_predicted_ttft_ms
    if threshold is not None and predicted_ttft_ms is not None and predicted_ttft_ms > threshold:
        return REASON_PREDICTED_TTFT
    return None


def open_endpoints(
    endpoints: Iterable[Endpoint],
    limits: SaturationLimits,
    now_s: float,
    predicted_ttft_ms: Mapping[str, float] | None = None,
) -> list[Endpoint]:
    """The ready endpoints that could start a request now; empty means the pool is saturated."""
    predicted = predicted_ttft_ms or {}
    return [e for e in endpoints if e.ready and endpoint_saturation(e, limits, now_s, predicted.get(e.id)) is None]


def saturation_reasons(endpoints: Iterable[Endpoint], limits: SaturationLimits, now_s: float) -> dict[str, str | None]:
    """Endpoint id -> why it is saturated (None: it is not), for status pages."""
    return {e.id: endpoint_saturation(e, limits, now_s) for e in endpoints if e.ready}

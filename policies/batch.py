"""Batch work: may it run now, and where: spare capacity as a pure function of the endpoints' state.

Batch lines run at the lowest priority and only on capacity interactive traffic does not need. An
endpoint has room for one more batch line when none of these holds:

- an interactive request waits anywhere for the pool (the gateway's waiting room or SLO queue):
  the pool is busy, batch backs off at once;
- the endpoint is not ready, or already runs `max_lines_per_endpoint` batch lines;
- its engine queues requests (`waiting` over `max_engine_waiting`, scraped; stale scrapes are not
  read) or its KV cache is fuller than `max_kv_usage_ratio`: a new sequence would wait or evict;
- it runs `max_endpoint_inflight` requests of any kind (when set);
- (`paced_starts`) the last batch line placed on it is still in its predicted prefill (placed less
  than its predicted TTFT ago): the prompts of several lines prefilled at once would fill the
  engine's step token budget for several steps, and an interactive request arriving then waits
  behind all of them. One at a time, what an arrival finds in its way is one line's prompt;
- the line's own predicted TTFT or TPOT there is over `slo_headroom` times the tightest interactive
  objective (when the pool has SLO classes and the predictor predicted): the engine's step time is
  already a good share of what interactive requests may have, so another sequence would eat into it.
  Not on an idle endpoint (nothing in flight, the engine running nothing): there the prediction is
  the line's own prefill and step, which no interactive request is waiting behind; refusing it would
  starve every line whose prompt alone takes longer than the headroom, on an idle fleet too.

The first five are read before a line is even taken (`pool_spare_slots`; with `paced_starts` an
endpoint offers one new line at a time), the last at routing time (`endpoint_spare`), where the
line's own prediction exists. A line already running is not stopped:
engines do not preempt, and the caps keep what a burst of interactive requests finds in its way to a
few sequences per engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from backends.types import Endpoint

REASON_INTERACTIVE_WAITING: Final = "interactive_waiting"
REASON_NOT_READY: Final = "not_ready"
REASON_BATCH_CAP: Final = "batch_cap"
REASON_ENGINE_QUEUE: Final = "engine_queue"
REASON_KV_USAGE: Final = "kv_usage"
REASON_INFLIGHT: Final = "inflight"
REASON_BATCH_PREFILLING: Final = "batch_prefilling"
REASON_PREDICTED_TTFT: Final = "predicted_ttft"
REASON_PREDICTED_TPOT: Final = "predicted_tpot"


@dataclass(frozen=True, slots=True)
class SpareLimits:
    max_lines_per_endpoint: int = 8
    max_engine_waiting: int = 0
    max_kv_usage_ratio: float | None = 0.6
    max_endpoint_inflight: int | None = None
    slo_headroom: float = 0.5
    max_stats_age_s: float = 2.0
    paced_starts: bool = False


@dataclass(frozen=True, slots=True)
class Objectives:
    """The tightest interactive latency objectives that apply on a pool (None: no such objective)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


@dataclass(frozen=True, slots=True)
class LinePrediction:
    """What the predictor expects of the batch line on one endpoint."""

    ttft_ms: float
    tpot_ms: float


def load_reason(
    endpoint: Endpoint, limits: SpareLimits, now_s: float, batch_lines: int, prefilling: bool = False
) -> str | None:
    """Why `endpoint` has no room for one more batch line, judged on its load alone (None: it has).
    `prefilling`: a batch line placed there is still within its predicted TTFT."""
    if not endpoint.ready:
        return REASON_NOT_READY
    if batch_lines >= limits.max_lines_per_endpoint:
        return REASON_BATCH_CAP
    if prefilling and limits.paced_starts:
        return REASON_BATCH_PREFILLING
    if limits.max_endpoint_inflight is not None and endpoint.inflight.requests >= limits.max_endpoint_inflight:
        return REASON_INFLIGHT
    if endpoint.stats_age_s(now_s) <= limits.max_stats_age_s:
        stats = endpoint.stats
        if stats.waiting > limits.max_engine_waiting:
            return REASON_ENGINE_QUEUE
        if limits.max_kv_usage_ratio is not None and stats.kv_usage_ratio > limits.max_kv_usage_ratio:
            return REASON_KV_USAGE
    return None


def idle(endpoint: Endpoint, limits: SpareLimits, now_s: float) -> bool:
    """Nothing runs on `endpoint`: no request in flight in the gateway's view (every replica's, when
    they share it) and, where its scrape is fresh, none running or waiting in the engine."""
    if endpoint.inflight.requests > 0:
        return False
    if endpoint.stats_age_s(now_s) <= limits.max_stats_age_s:
        stats = endpoint.stats
        return stats.running == 0 and stats.waiting == 0
    return True


def prediction_reason(predicted: LinePrediction | None, objectives: Objectives, limits: SpareLimits) -> str | None:
    """Why the line's prediction says the endpoint is too busy for batch work (None: it is not)."""
    if predicted is None:
        return None
    if objectives.ttft_ms is not None and predicted.ttft_ms > limits.slo_headroom * objectives.ttft_ms:
        return REASON_PREDICTED_TTFT
    if objectives.tpot_ms is not None and predicted.tpot_ms > limits.slo_headroom * objectives.tpot_ms:
        return REASON_PREDICTED_TPOT
    return None


def endpoint_spare(
    endpoint: Endpoint,
    limits: SpareLimits,
    now_s: float,
    batch_lines: int,
    *,
    interactive_waiting: int = 0,
    predicted: LinePrediction | None = None,
    objectives: Objectives = Objectives(),
    prefilling: bool = False,
) -> str | None:
    """Why one more batch line may not start on `endpoint` now (a reason label), or None."""
    if interactive_waiting > 0:
        return REASON_INTERACTIVE_WAITING
    reason = load_reason(endpoint, limits, now_s, batch_lines, prefilling)
    if reason is not None or idle(endpoint, limits, now_s):
        return reason
    return prediction_reason(predicted, objectives, limits)


def pool_spare_slots(
    endpoints: Iterable[Endpoint],
    limits: SpareLimits,
    now_s: float,
    batch_lines_by_endpoint: Mapping[str, int],
    interactive_waiting: int = 0,
    prefilling: Callable[[str], bool] = lambda endpoint_id: False,
) -> int:
    """How many more batch lines the pool may start now: the free batch slots of the endpoints with
    room, one each with `paced_starts` (0 while interactive requests wait for the pool). The one
    question the batch runner asks."""
    if interactive_waiting > 0:
        return 0
    slots = 0
    for endpoint in endpoints:
        running = batch_lines_by_endpoint.get(endpoint.id, 0)
        if load_reason(endpoint, limits, now_s, running, prefilling(endpoint.id)) is None:
            slots += 1 if limits.paced_starts else limits.max_lines_per_endpoint - running
    return slots


def tightest(objectives: Iterable[Objectives]) -> Objectives:
    """The tightest TTFT and TPOT over several classes' objectives."""
    listed = list(objectives)
    ttft = [o.ttft_ms for o in listed if o.ttft_ms is not None]
    tpot = [o.tpot_ms for o in listed if o.tpot_ms is not None]
    return Objectives(min(ttft) if ttft else None, min(tpot) if tpot else None)

"""The record of one finished request: what every accounting sink (metrics, ledger, traces, predictor
feedback) reads. The request lifecycle fills it as the request walks and hands it over exactly once,
whatever the outcome (success, error, rejection, client abort).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["ok", "error", "rejected", "aborted"]


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    api: str  # chat | completions | embeddings
    started_at_unix_s: float  # wall clock at arrival
    tenant: str = ""
    key_id: str = ""
    requested_model: str = ""
    model: str = ""  # public model that served (after fallback)
    served_model: str = ""  # upstream model name
    base_model: str | None = None  # `model` is a LoRA adapter: the model it adapts (docs/adapters.md)
    fallback_from: str | None = None
    fallback_reason: str | None = None
    pool: str = ""
    endpoint: str = ""  # endpoint id
    engine: str = ""  # adapter kind of that endpoint (vllm, trtllm, sim, ...): gen_ai.provider.name
    prefill_endpoint: str = ""
    route_reason: str = ""
    pd_reason: str | None = None  # disaggregated pools: why (not) disaggregated
    kv_transfer_failed: bool = False  # the PD prefill leg failed; the decode endpoint prefilled itself
    stream: bool = False
    status: Status = "ok"
    http_status: int = 200
    error_code: str | None = None  # catalogue code or upstream error label
    reject_reason: str | None = None  # rate_limited, budget_exhausted, slo_unattainable, ...
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cache_write_tokens: int = 0  # prompt tokens written to a hosted provider's cache (default lifetime)
    cache_write_1h_tokens: int = 0  # ... with a one-hour lifetime
    reasoning_tokens: int = 0  # output tokens the provider counted as reasoning
    cache_saved_usd: float = 0.0  # what the request would have cost with no prompt cache, less its cost
    usage_source: Literal["engine", "counted", "reserved", "none"] = "none"
    cost_usd: float = 0.0
    ttft_s: float | None = None  # client-observed at the gateway: arrival -> first content byte sent
    tpot_s: float | None = None  # mean time per output token after the first
    duration_s: float = 0.0  # arrival -> last byte
    gateway_overhead_s: float = 0.0  # time spent in the gateway itself before the upstream call
    upstream_attempts: int = 0
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    slo_class: str | None = None  # the SLO class that applied, when one did
    slo_idle_admit: bool = False  # no endpoint met the SLO; an idle one admitted it anyway
    queue_ms: float | None = None  # time spent waiting in the gateway (flow control), when it waited
    engine_metrics: dict[str, Any] | None = None  # the engine's own per-request timings (the simulator's)
    cold_start_ms: float | None = None  # held while a replica of its pool started or woke
    migrations: int = 0  # times its stream continued on another replica after its own cut it
    preempted: int = 0  # times flow control cut its stream for another tenant's request (it continued)
    batch_id: str | None = None  # a line of this batch (Batch API)
    program: str | None = None  # intake: the agent program it belongs to, bounded (gateway/request/intake.py)
    user: str | None = None  # intake: the end user it names, bounded (gateway/request/intake.py)
    tags: tuple[str, ...] = ()  # intake: its tags, bounded (gateway/request/intake.py)
    spill: str | None = None  # served on an overflow pool, and why (gateway/flow/checks.py)
    # a stream that failed over to a fallback model mid-answer (gateway/transport/engine.py) leaves one
    # record per leg: its number (1, 2, ...; 0: the stream never failed over) and the leg it continues
    leg: int = 0
    continues: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

"""The usage ledger's line format: one JSON object per finished request, one line per object.

Field names are the ledger's own, decoupled from `RequestRecord`'s attributes, so files written
today stay readable whatever the dataclass becomes; `v` is the schema version. Readers must accept
unknown fields (newer writers) and missing optional ones (older writers).

v1 fields: v, ts (finish, unix s), started (arrival, unix s), request_id, api, tenant, key_id,
requested_model, model, served_model, fallback_from, fallback_reason, pool, endpoint,
prefill_endpoint, engine, stream, status, http_status, error_code, reject_reason, input_tokens
(includes cached), cached_input_tokens, output_tokens, usage_source, cost_usd, ttft_s, tpot_s,
duration_s, gateway_overhead_s, upstream_attempts, route_reason, pd_reason, kv_transfer_failed,
`batch_id` on the records of batch lines (Batch API); `base_model` on the records of requests for a
LoRA adapter (`model` is the adapter; docs/adapters.md); `program` on the records of requests that
name their agent program (docs/agents.md); `user` (the end user) and `tags` (a list) on the records
of requests that name them (docs/governance.md); `leg` and `continues` on the records of a stream that
failed over to a fallback model mid-answer (one record per leg, numbered from 1; `continues` is the
request id of the leg before, null on the first: docs/agents.md); cache_write_input_tokens,
cache_write_1h_input_tokens (part of input_tokens, apart from cached_input_tokens, the cache reads),
reasoning_tokens (part of output_tokens) and cache_saved_usd (the cost with no prompt cache, less
cost_usd; negative when writes cost more than reads saved) when any is non-zero; and `extra` when
the record carries any of: slo_class, slo_idle_admit, queue_ms, spill (why it went to an overflow
pool), engine (the engine's own per-request timings).

Beside request records the ledger holds one record of kind `outcome` per agent program that posted
how it ended (`gateway/http/outcome.py`): v, kind, ts, started, request_id, tenant, key_id, program,
success, value. Request reports skip them (`report.py`); `--by outcome` joins them (`outcomes.py`).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.request.record import RequestRecord

SCHEMA_VERSION = 1


def record_to_entry(r: RequestRecord) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "ts": round(r.started_at_unix_s + r.duration_s, 6),
        "started": round(r.started_at_unix_s, 6),
        "request_id": r.request_id,
        "api": r.api,
        "tenant": r.tenant,
        "key_id": r.key_id,
        "requested_model": r.requested_model,
        "model": r.model,
        "served_model": r.served_model,
        "fallback_from": r.fallback_from,
        "fallback_reason": r.fallback_reason,
        "pool": r.pool,
        "endpoint": r.endpoint,
        "prefill_endpoint": r.prefill_endpoint,
        "engine": r.engine,
        "stream": r.stream,
        "status": r.status,
        "http_status": r.http_status,
        "error_code": r.error_code,
        "reject_reason": r.reject_reason,
        "input_tokens": r.prompt_tokens,
        "cached_input_tokens": r.cached_tokens,
        "output_tokens": r.completion_tokens,
        "usage_source": r.usage_source,
        "cost_usd": r.cost_usd,
        "ttft_s": r.ttft_s,
        "tpot_s": r.tpot_s,
        "duration_s": r.duration_s,
        "gateway_overhead_s": r.gateway_overhead_s,
        "upstream_attempts": r.upstream_attempts,
        "route_reason": r.route_reason,
        "pd_reason": r.pd_reason,
        "kv_transfer_failed": r.kv_transfer_failed,
    }
    if r.cache_write_tokens or r.cache_write_1h_tokens or r.reasoning_tokens or r.cache_saved_usd:
        entry["cache_write_input_tokens"] = r.cache_write_tokens
        entry["cache_write_1h_input_tokens"] = r.cache_write_1h_tokens
        entry["reasoning_tokens"] = r.reasoning_tokens
        entry["cache_saved_usd"] = r.cache_saved_usd
    if r.batch_id is not None:
        entry["batch_id"] = r.batch_id
    if r.program is not None:
        entry["program"] = r.program
    if r.base_model is not None:
        entry["base_model"] = r.base_model
    if r.user is not None:
        entry["user"] = r.user
    if r.tags:
        entry["tags"] = list(r.tags)
    if r.leg:
        entry["leg"] = r.leg
        entry["continues"] = r.continues
    extra = _extra(r)
    if extra:
        entry["extra"] = extra
    return entry


def _extra(r: RequestRecord) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if r.slo_class:
        extra["slo_class"] = r.slo_class
    if r.slo_idle_admit:
        extra["slo_idle_admit"] = True
    if r.queue_ms is not None:
        extra["queue_ms"] = r.queue_ms
    if r.spill is not None:
        extra["spill"] = r.spill
    if r.engine_metrics:
        extra["engine"] = r.engine_metrics
    return extra


def encode(record: RequestRecord) -> bytes:
    """One ledger line, newline included. Unknown types in `extra` are written as strings; text that
    is not valid UTF-8 (a header's undecodable bytes) is written with replacement characters, so a
    request never goes unrecorded for what a client sent."""
    entry = record_to_entry(record)
    try:
        return orjson.dumps(entry, default=str, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return orjson.dumps(_valid_text(entry), default=str, option=orjson.OPT_APPEND_NEWLINE)


def _valid_text(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(value, dict):
        return {_valid_text(k): _valid_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_valid_text(v) for v in value]
    return value


def decode(line: bytes) -> dict[str, Any]:
    """One entry from a line (newline optional); raises ValueError when it is not a JSON object."""
    entry = orjson.loads(line)
    if not isinstance(entry, dict):
        raise ValueError("a ledger line must be a JSON object")
    return entry

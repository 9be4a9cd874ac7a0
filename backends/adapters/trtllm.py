"""TensorRT-LLM `trtllm-serve`: underscore flags, a YAML `--config`, strict request bodies, `trtllm_*`
Prometheus metrics or JSON iteration stats, and the `disaggregated_params` PD handshake.

Facts from TensorRT-LLM's source (`NVIDIA/TensorRT-LLM` main; `tensorrt_llm/serve/openai_protocol.py` for
the accepted request fields); each rule below names its file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from backends.adapters.base import (
    MAX_SAMPLE_VALUE,
    PRIORITY_MAX,
    PRIORITY_MIN,
    LaunchSpec,
    Probe,
    ReplicaPlan,
    connect_host,
    first_present,
    mean,
    parse_samples,
    total,
)
from backends.adapters.vllm import clamp_priority, wants_priority
from backends.config import PoolConfig
from backends.types import EndpointStats, MetricsFormatError, PdHandshakeError, Role

# Prometheus names (tensorrt_llm/metrics/collector.py).
RUNNING = ("trtllm_num_requests_running",)
WAITING = ("trtllm_num_requests_waiting",)
KV_UTILIZATION = ("trtllm_kv_cache_utilization",)
REUSED_BLOCKS = ("trtllm_kv_cache_reused_blocks_total", "trtllm_kv_cache_reused_blocks")
MISSED_BLOCKS = ("trtllm_kv_cache_missed_blocks_total", "trtllm_kv_cache_missed_blocks")
MAX_BLOCKS = ("trtllm_kv_cache_max_blocks",)
FREE_BLOCKS = ("trtllm_kv_cache_free_blocks",)
USED_BLOCKS = ("trtllm_kv_cache_used_blocks",)
TOKENS_PER_BLOCK = ("trtllm_kv_cache_tokens_per_block",)
WANTED = frozenset(
    RUNNING
    + WAITING
    + KV_UTILIZATION
    + REUSED_BLOCKS
    + MISSED_BLOCKS
    + MAX_BLOCKS
    + FREE_BLOCKS
    + USED_BLOCKS
    + TOKENS_PER_BLOCK
)

# Request models are `extra="forbid"`: any other field is a 400 (openai_protocol.py). These are the fields
# of ChatCompletionRequest / CompletionRequest in tensorrt_llm/serve/openai_protocol.py, minus the
# ones older builds reject (cache_salt).
_SAMPLING_EXTRAS = frozenset({
    "best_of", "use_beam_search", "top_k", "top_p_min", "min_p", "repetition_penalty",
    "length_penalty", "early_stopping", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "lora_request", "add_special_tokens", "response_format", "disaggregated_params", "priority",
})  # fmt: skip
ACCEPTED_FIELDS: Mapping[str, frozenset[str]] = {
    "chat": _SAMPLING_EXTRAS | {
        "messages", "prompt_token_ids", "model", "frequency_penalty", "logit_bias", "logprobs",
        "top_logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream",
        "stream_options", "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls",
        "user", "reasoning_effort", "echo", "add_generation_prompt", "documents", "chat_template",
        "chat_template_kwargs",
    },
    "completions": _SAMPLING_EXTRAS | {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
        "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
        "temperature", "top_p", "user", "return_context_logits", "detokenize",
    },
    "embeddings": frozenset({"model", "input", "encoding_format", "dimensions", "user"}),
}  # fmt: skip

SERVER_ROLE = {Role.PREFILL: "CONTEXT", Role.DECODE: "GENERATION"}  # --server_role (commands/serve.py)


@dataclass(frozen=True, slots=True)
class TrtllmAdapter:
    kind: str = "trtllm"
    executable: tuple[str, ...] = ("trtllm-serve",)
    launches: bool = True
    uses_devices: bool = True
    device_env: str | None = "CUDA_VISIBLE_DEVICES"
    device_tool: str | None = "nvidia-smi"
    supports_pd: bool = True
    health_path: str = "/health"
    # Prometheus first (needs return_perf_metrics, which the config sets); older builds only have
    # the JSON iteration stats at /metrics, drained on read (tensorrt_llm/serve/openai_server.py).
    metrics_paths: tuple[str, ...] = ("/prometheus/metrics", "/metrics")
    # No --served_model_name: the id is the model dir basename or hub id, read from /v1/models (commands/serve.py).
    kv_events_port_needed: bool = False
    kv_transfer_port_needed: bool = False
    discovers_model_name: bool = True

    # --- launching -------------------------------------------------------------------------------

    def validate(self, pool: PoolConfig) -> list[str]:
        problems = []
        if pool.api_key:
            problems.append("trtllm-serve has no --api-key: drop `api_key`")
        if pool.lora_modules:
            problems.append("trtllm-serve loads LoRA per request (`lora_request`): drop `lora_modules`")
        if pool.served_model_name:
            problems.append("trtllm-serve has no --served_model_name: drop `served_model_name`")
        return problems

    def served_model(self, pool: PoolConfig) -> str:
        model = pool.engine_model or pool.model
        if model.startswith(("/", "./", "../", "~")):
            return os.path.basename(model.rstrip("/"))
        return model

    def config_path(self, replica: ReplicaPlan) -> str:
        return os.path.join(replica.run_dir, f"{replica.file_stem}.trtllm.yaml")

    def engine_config(self, pool: PoolConfig, replica: ReplicaPlan) -> dict[str, Any]:
        """The `--config` YAML (LlmArgs, tensorrt_llm/llmapi/llm_args.py)."""
        kv_cache: dict[str, Any] = {"enable_block_reuse": pool.enable_prefix_caching}
        if pool.block_size is not None:
            kv_cache["tokens_per_block"] = pool.block_size
        if pool.gpu_memory_utilization is not None:
            # Fraction of memory free after weights, unlike vLLM's fraction of total (llm_args.py).
            kv_cache["free_gpu_memory_fraction"] = pool.gpu_memory_utilization
        # 0 disables KV events (llm_args.py); a positive buffer makes POST /kv_cache_events work (openai_server.py).
        kv_cache["event_buffer_max_size"] = 16384 if pool.kv_events.enabled else 0
        config: dict[str, Any] = {
            "kv_cache_config": kv_cache,
            "enable_iter_perf_stats": True,  # needed for /metrics (llm_args.py)
            "return_perf_metrics": True,  # needed for /prometheus/metrics (metrics/collector.py)
        }
        if pool.priority_scheduling:
            config["scheduler_config"] = {"waiting_queue_policy": "priority"}  # priority honoured (llm_args.py)
        if replica.role is not Role.BOTH or pool.kv_transfer is not None:
            config["cache_transceiver_config"] = dict(pool.kv_transfer or {"backend": "DEFAULT"})
        return _deep_merge(config, pool.engine_config)

    def launch_spec(self, pool: PoolConfig, replica: ReplicaPlan) -> LaunchSpec:
        config_path = self.config_path(replica)
        argv = [*(pool.engine_bin or self.executable), pool.engine_model or pool.model]
        # --host explicitly: trtllm-serve defaults to localhost (commands/serve.py).
        argv += ["--host", replica.host, "--port", str(replica.port)]
        argv += ["--tp_size", str(pool.tensor_parallel), "--pp_size", str(pool.pipeline_parallel)]
        if pool.max_model_len:
            argv += ["--max_seq_len", str(pool.max_model_len)]
        if pool.tokenizer:
            argv += ["--tokenizer", pool.tokenizer]
        if pool.max_num_seqs:
            argv += ["--max_batch_size", str(pool.max_num_seqs)]
        if pool.max_num_batched_tokens:
            argv += ["--max_num_tokens", str(pool.max_num_batched_tokens)]
        argv += ["--config", config_path]
        if replica.role in SERVER_ROLE:
            argv += ["--server_role", SERVER_ROLE[replica.role]]
        argv += pool.extra_args
        env: dict[str, str] = {}
        if replica.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in replica.devices)
        content = yaml.safe_dump(self.engine_config(pool, replica), sort_keys=False)
        return LaunchSpec(
            argv=tuple(argv),
            env={**env, **pool.env},
            log_path=replica.log_path,
            files={config_path: content},
        )

    def kv_events_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        # HTTP pull only (POST /kv_cache_events, tensorrt_llm/serve/openai_server.py): the subscriber POSTs here.
        if not pool.kv_events.enabled:
            return None
        return f"http://{connect_host(replica.host)}:{replica.port}/kv_cache_events"

    def kv_events_replay_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        return None  # HTTP pull drains a buffer: nothing to replay

    # --- readiness and metrics -------------------------------------------------------------------

    def classify_health(self, status: int | None, headers: Mapping[str, str]) -> Probe:
        if status is None:
            return Probe.STARTING  # older builds refuse connections while loading (openai_server.py)
        if status == 200:
            return Probe.READY
        # Newer builds listen at once and answer 503 with this header until ready (tensorrt_llm/serve/readiness.py).
        state = next((v for k, v in headers.items() if k.lower() == "x-trtllm-server-state"), "")
        if status == 503 and state.lower() == "starting":
            return Probe.STARTING
        return Probe.FAILING

    def parse_metrics(self, payload: Any, previous: EndpointStats | None = None) -> EndpointStats:
        if isinstance(payload, bytes):
            payload = payload.decode()
        if isinstance(payload, str):
            stripped = payload.lstrip()
            if stripped.startswith(("[", "{")):
                try:
                    payload = json.loads(stripped)
                except (ValueError, RecursionError) as exc:  # RecursionError: nesting past the stack
                    raise MetricsFormatError(f"trtllm: malformed JSON iteration stats: {exc}") from exc
            else:
                return self._parse_prometheus(payload, previous)
        if isinstance(payload, dict):
            payload = [payload]
        if not isinstance(payload, list):
            raise MetricsFormatError(f"trtllm: unexpected metrics payload {type(payload).__name__}")
        return self._parse_iteration_stats(payload, previous)

    def _parse_prometheus(self, text: str, previous: EndpointStats | None) -> EndpointStats:
        samples = parse_samples(text, WANTED)
        running = total(first_present(samples, RUNNING))
        waiting = total(first_present(samples, WAITING))
        utilization = mean(first_present(samples, KV_UTILIZATION))
        max_blocks = total(first_present(samples, MAX_BLOCKS))
        if utilization is None and max_blocks:
            used = total(first_present(samples, USED_BLOCKS))
            free = total(first_present(samples, FREE_BLOCKS))
            if used is None and free is not None:
                used = max_blocks - free
            utilization = None if used is None else used / max_blocks
        if running is None and waiting is None and utilization is None:
            raise MetricsFormatError("trtllm: no trtllm_num_requests_* or KV cache metrics in the payload")
        tokens_per_block = total(first_present(samples, TOKENS_PER_BLOCK))
        return _stats(
            previous,
            running=running,
            waiting=waiting,
            kv_usage=utilization,
            reused_blocks=total(first_present(samples, REUSED_BLOCKS)),
            missed_blocks=total(first_present(samples, MISSED_BLOCKS)),
            tokens_per_block=tokens_per_block,
            max_blocks=max_blocks,
        )

    def _parse_iteration_stats(self, items: list[Any], previous: EndpointStats | None) -> EndpointStats:
        prev = previous or EndpointStats()
        stats = [s for s in items if isinstance(s, dict)]
        if not stats:
            # Drained and empty: no iteration ran since the last read, so nothing is scheduled.
            return _stats(prev, running=0, waiting=0)
        last = max(stats, key=lambda s: _num(s.get("iter")) or 0.0)
        kv = _object(last.get("kvCacheStats"))
        batching = _object(last.get("inflightBatchingStats"))
        if "numActiveRequests" not in last and not kv:
            raise MetricsFormatError("trtllm: iteration stats without numActiveRequests or kvCacheStats")
        max_blocks = _num(kv.get("maxNumBlocks"))
        kv_usage = None
        if max_blocks:
            # 1 - free/total like vLLM's kv_cache_usage_perc; Dynamo's allocTotalBlocks/maxNumBlocks
            # (`ai-dynamo/dynamo`, its TRT-LLM stats publisher) only when the used/free counts are missing.
            used = _num(kv.get("usedNumBlocks"))
            if used is None and _num(kv.get("freeNumBlocks")) is not None:
                used = max_blocks - (_num(kv.get("freeNumBlocks")) or 0.0)
            if used is None:
                used = _num(kv.get("allocTotalBlocks"))
            kv_usage = None if used is None else used / max_blocks
        queued = _num(last.get("numQueuedRequests"))
        paused = _num(batching.get("numPausedRequests")) or 0.0
        return _stats(
            prev,
            running=_num(last.get("numActiveRequests")),
            # Dynamo's derivation: waiting = queued + paused (its TRT-LLM stats publisher).
            waiting=None if queued is None else queued + paused,
            kv_usage=kv_usage,
            reused_blocks=_num(kv.get("reusedBlocks")),
            missed_blocks=_num(kv.get("missedBlocks")),
            tokens_per_block=_num(kv.get("tokensPerBlock")),
            max_blocks=max_blocks,
        )

    # --- requests --------------------------------------------------------------------------------

    def shape_request(self, body: Mapping[str, Any], api: str, pool: PoolConfig | None = None) -> dict[str, Any]:
        accepted = ACCEPTED_FIELDS.get(api, ACCEPTED_FIELDS["chat"])
        shaped = {k: v for k, v in body.items() if k in accepted}
        if api == "chat" and "max_completion_tokens" in body:
            # `max_completion_tokens` is the field, `max_tokens` its validation alias: send only one.
            shaped.setdefault("max_tokens", body["max_completion_tokens"])
        if not shaped.get("stream"):
            shaped.pop("stream_options", None)  # only allowed with stream=true (openai_protocol.py)
        if "priority" in shaped:
            priority = clamp_priority(shaped.pop("priority"))
            if priority is not None and wants_priority(pool):
                # float 0..1, higher first; tokenway's normal (0) lands on TRT's default 0.5 (openai_protocol.py).
                shaped["priority"] = (priority - PRIORITY_MIN) / (PRIORITY_MAX - PRIORITY_MIN)
        return shaped

    def prefill_leg_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        leg = {k: v for k, v in body.items() if k != "stream_options"}
        leg["stream"] = False  # the context leg is non-streaming (disaggregated/test_workers.py)
        leg["disaggregated_params"] = {"request_type": "context_only"}
        return leg

    def decode_leg_body(self, body: Mapping[str, Any], prefill_response: Mapping[str, Any]) -> dict[str, Any]:
        choices = prefill_response.get("choices") or []
        params = choices[0].get("disaggregated_params") if choices and isinstance(choices[0], dict) else None
        if not isinstance(params, dict):
            raise PdHandshakeError("trtllm: the context server's response has no choices[0].disaggregated_params")
        leg = dict(body)
        leg["disaggregated_params"] = {**params, "request_type": "generation_only"}  # disaggregated/test_workers.py
        token_ids = prefill_response.get("prompt_token_ids")
        if token_ids is not None and "messages" in body:
            leg["prompt_token_ids"] = token_ids  # spares the generation server a re-tokenization
        return leg


def _stats(
    previous: EndpointStats | None,
    *,
    running: float | None = None,
    waiting: float | None = None,
    kv_usage: float | None = None,
    reused_blocks: float | None = None,
    missed_blocks: float | None = None,
    tokens_per_block: float | None = None,
    max_blocks: float | None = None,
) -> EndpointStats:
    """EndpointStats from TRT-LLM's block counts (hits/queries in tokens), keeping what is missing."""
    prev = previous or EndpointStats()
    block_size = int(tokens_per_block) if tokens_per_block else prev.block_size
    hits, queries = prev.prefix_cache_hits_tokens, prev.prefix_cache_queries_tokens
    if reused_blocks is not None and block_size:
        hits = reused_blocks * block_size
        queries = (reused_blocks + (missed_blocks or 0.0)) * block_size
    return EndpointStats(
        running=int(running) if running is not None else prev.running,
        waiting=int(waiting) if waiting is not None else prev.waiting,
        kv_usage_ratio=min(1.0, max(0.0, kv_usage)) if kv_usage is not None else prev.kv_usage_ratio,
        prefix_cache_hits_tokens=hits,
        prefix_cache_queries_tokens=queries,
        preemptions=prev.preemptions,
        block_size=block_size,
        num_gpu_blocks=int(max_blocks) if max_blocks else prev.num_gpu_blocks,
    )


def _num(value: Any) -> float | None:
    """A JSON number that is one: Python's json reads NaN and Infinity, and an int past a float's
    range; none is a count (`int()` of an infinity raises)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int):
        return float(value) if abs(value) <= MAX_SAMPLE_VALUE else None
    return value if math.isfinite(value) and abs(value) <= MAX_SAMPLE_VALUE else None


def _object(value: Any) -> dict[str, Any]:
    """A stats sub-object, or an empty one when the engine sent anything else there."""
    return value if isinstance(value, dict) else {}


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


TRTLLM = TrtllmAdapter()

"""A remote OpenAI-compatible API (OpenAI itself, a hosted provider): static endpoints only.

Nothing to launch and no metrics to scrape; health is `GET /v1/models` with the pool's key (hosted
APIs have no `/health`), and requests are cut down to OpenAI's documented fields, because OpenAI
answers 400 to unknown parameters and engine extras (`kv_transfer_params`, `priority`, ...) mean
nothing there. OpenAI-compatible hosts often accept more (`top_k`, `guided_json`, `repetition_penalty`):
a pool lists those in `extra_request_fields` (or `['*']` to forward everything).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.adapters.base import LaunchSpec, Probe, ReplicaPlan
from backends.config import PoolConfig
from backends.types import EndpointStats, PdUnsupportedError, PlanError

# Request fields of OpenAI's API reference (chat/create, completions/create, embeddings/create).
ACCEPTED_FIELDS: Mapping[str, frozenset[str]] = {
    "chat": frozenset({
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
        "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
        "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
        "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop",
        "store", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
        "top_p", "user", "verbosity", "web_search_options",
    }),
    "completions": frozenset({
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
        "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
        "temperature", "top_p", "user",
    }),
    "embeddings": frozenset({"model", "input", "dimensions", "encoding_format", "user"}),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class OpenAIRemoteAdapter:
    kind: str = "openai"
    launches: bool = False
    uses_devices: bool = False
    device_env: str | None = None
    device_tool: str | None = None
    supports_pd: bool = False
    health_path: str = "/v1/models"
    metrics_paths: tuple[str, ...] = ()
    kv_events_port_needed: bool = False
    kv_transfer_port_needed: bool = False
    discovers_model_name: bool = False

    def validate(self, pool: PoolConfig) -> list[str]:
        return []  # PoolConfig already refuses launched replicas for `openai`

    def served_model(self, pool: PoolConfig) -> str:
        return pool.upstream_model

    def launch_spec(self, pool: PoolConfig, replica: ReplicaPlan) -> LaunchSpec:
        raise PlanError(f"pool {pool.name!r}: engine `openai` is a remote API and launches nothing")

    def kv_events_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        return None

    def kv_events_replay_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        return None

    def classify_health(self, status: int | None, headers: Mapping[str, str]) -> Probe:
        if status is None:
            return Probe.FAILING  # a remote API never "starts": unreachable is a failure
        # 401/403 mean a wrong key: every request would fail too.
        return Probe.READY if 200 <= status < 300 else Probe.FAILING

    def parse_metrics(self, payload: Any, previous: EndpointStats | None = None) -> EndpointStats:
        return previous or EndpointStats()  # no metrics: load comes from gateway-side accounting

    def shape_request(self, body: Mapping[str, Any], api: str, pool: PoolConfig | None = None) -> dict[str, Any]:
        """OpenAI's documented fields plus the pool's `extra_request_fields` (`*`: everything); the
        rest is dropped (the gateway names what was dropped in `x-tokenway-dropped-fields` on debug)."""
        extra = pool.extra_request_fields if pool is not None else ()
        if "*" in extra:
            return dict(body)
        accepted = ACCEPTED_FIELDS.get(api, ACCEPTED_FIELDS["chat"])
        return {k: v for k, v in body.items() if k in accepted or k in extra}

    def prefill_leg_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        raise PdUnsupportedError("engine `openai` (remote API) has no prefill/decode disaggregation")

    def decode_leg_body(self, body: Mapping[str, Any], prefill_response: Mapping[str, Any]) -> dict[str, Any]:
        raise PdUnsupportedError("engine `openai` (remote API) has no prefill/decode disaggregation")


OPENAI_REMOTE = OpenAIRemoteAdapter()

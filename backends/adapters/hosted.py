"""Adapters of the engines tokenway does not launch: hosted providers and remote OpenAI-compatible APIs
(static endpoints only, no launch, no prefill/decode handshake).

Hosted providers
----------------
Hosted providers' own APIs (Anthropic, Bedrock, Gemini/Vertex AI, Azure OpenAI): static endpoints only.

Nothing to launch, no metrics to scrape. Health does not call the provider: every cheap-looking probe
is either billed, rate-limited with the traffic, or absent (Bedrock, Vertex AI), so a hosted endpoint
is taken as ready (`health_path` empty: `backends/fleet.py` probes nothing) and the gateway's passive
ejection takes it out on failures (connect errors, 5xx, throttling) and lets it back after its
cooldown, as any endpoint. Requests reach the provider through `backends/hosted/` codecs, which refuse
any field they do not know: `shape_request` keeps the chat body's own fields and takes out what the
gateway adds for its engines (`priority`, `cache_salt`, `kv_transfer_params`, ...).

Remote OpenAI-compatible APIs
-----------------------------
A remote OpenAI-compatible API (OpenAI itself, a hosted provider): static endpoints only.

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

# The engine-control fields (policies/policy.py's ENGINE_CONTROL_FIELDS: the gateway's own for
# its engines, a client's only where its tenant may set them): they mean nothing to a provider's API,
# which would refuse them. A client's other fields (`top_k`, `guided_json`, ...) reach the codec, which
# refuses them by name.
ENGINE_ONLY_FIELDS = frozenset({
    "kv_transfer_params", "ec_transfer_params", "disaggregated_params", "priority", "cache_salt",
    "request_id", "session_id", "vllm_xargs", "lora_request",
})  # fmt: skip


@dataclass(frozen=True, slots=True)
class HostedAdapter:
    kind: str
    launches: bool = False
    uses_devices: bool = False
    device_env: str | None = None
    device_tool: str | None = None
    supports_pd: bool = False
    health_path: str = ""  # no active probe: ready until passive ejection says otherwise
    metrics_paths: tuple[str, ...] = ()
    kv_events_port_needed: bool = False
    kv_transfer_port_needed: bool = False
    discovers_model_name: bool = False

    def validate(self, pool: PoolConfig) -> list[str]:
        return []  # PoolConfig refuses launched replicas and misplaced provider fields

    def served_model(self, pool: PoolConfig) -> str:
        return pool.upstream_model

    def launch_spec(self, pool: PoolConfig, replica: ReplicaPlan) -> LaunchSpec:
        raise PlanError(f"pool {pool.name!r}: engine `{self.kind}` is a hosted API and launches nothing")

    def kv_events_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        return None

    def kv_events_replay_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        return None

    def classify_health(self, status: int | None, headers: Mapping[str, str]) -> Probe:
        return Probe.READY  # never probed over the network (see the module's docstring)

    def parse_metrics(self, payload: Any, previous: EndpointStats | None = None) -> EndpointStats:
        return previous or EndpointStats()  # load comes from gateway-side accounting

    def shape_request(self, body: Mapping[str, Any], api: str, pool: PoolConfig | None = None) -> dict[str, Any]:
        """The body without the gateway's engine-only fields; the codec refuses (or, where the pool
        allows dropping, names) whatever else the provider has no place for."""
        return {k: v for k, v in body.items() if k not in ENGINE_ONLY_FIELDS}

    def prefill_leg_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        raise PdUnsupportedError(f"engine `{self.kind}` (hosted API) has no prefill/decode disaggregation")

    def decode_leg_body(self, body: Mapping[str, Any], prefill_response: Mapping[str, Any]) -> dict[str, Any]:
        raise PdUnsupportedError(f"engine `{self.kind}` (hosted API) has no prefill/decode disaggregation")


ANTHROPIC = HostedAdapter("anthropic")
BEDROCK = HostedAdapter("bedrock")
GEMINI = HostedAdapter("gemini")
AZURE_OPENAI = HostedAdapter("azure-openai")


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

"""Hosted providers' own APIs (Anthropic, Bedrock, Gemini/Vertex AI, Azure OpenAI): static endpoints only.

Nothing to launch, no metrics to scrape. Health does not call the provider: every cheap-looking probe
is either billed, rate-limited with the traffic, or absent (Bedrock, Vertex AI), so a hosted endpoint
is taken as ready (`health_path` empty: `backends/health.py` probes nothing) and the gateway's passive
ejection takes it out on failures (connect errors, 5xx, throttling) and lets it back after its
cooldown, as any endpoint. Requests reach the provider through `backends/hosted/` codecs, which refuse
any field they do not know: `shape_request` keeps the chat body's own fields and takes out what the
gateway adds for its engines (`priority`, `cache_salt`, `kv_transfer_params`, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.adapters.base import LaunchSpec, Probe, ReplicaPlan
from backends.config import PoolConfig
from backends.types import EndpointStats, PdUnsupportedError, PlanError

# The engine-control fields (policies/engine_fields.py's ENGINE_CONTROL_FIELDS: the gateway's own for
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

"""Pool configuration as it appears under `pools:` in gateway.yaml (pydantic: config only).

A pool is a homogeneous group of endpoints serving one public model name: replicas that the
supervisor launches (engine + launch spec) and/or static endpoints (remote vLLM, hosted APIs).
Several pools may serve the same public model (a model group), e.g. local replicas plus a remote
fallback.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.types import Role

EngineKind = Literal["sim", "vllm", "trtllm", "vllm-ascend", "openai"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StaticEndpointConfig(_Strict):
    """An endpoint the gateway does not launch."""

    url: str = Field(description="base URL without /v1, e.g. http://10.0.0.5:8000")
    role: Role = Role.BOTH
    api_key: str | None = None
    kv_events_endpoint: str | None = None

    @field_validator("url")
    @classmethod
    def _strip(cls, value: str) -> str:
        value = value.rstrip("/")
        if value.endswith("/v1"):
            value = value[: -len("/v1")]
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value


class KvEventsConfig(_Strict):
    enabled: bool = False
    port_base: int | None = Field(default=None, description="first ZMQ port; one per replica; auto if null")
    topic: str = "kv-events"


class PoolConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: str = Field(description="public model name clients send")
    engine: EngineKind = "sim"
    engine_model: str | None = Field(default=None, description="what the engine loads (HF id / path)")
    served_model_name: str | None = Field(default=None, description="name in upstream request bodies")
    engine_bin: list[str] | None = Field(default=None, description="overrides the engine executable")
    replicas: int = Field(default=0, ge=0, description="launched replicas with role `both`")
    roles: dict[Literal["prefill", "decode"], int] | None = Field(
        default=None, description="launched replicas per PD role (instead of `replicas`)"
    )
    endpoints: list[StaticEndpointConfig] = Field(default_factory=list)
    # launch spec
    host: str = "127.0.0.1"
    port_base: int | None = None
    devices: list[int] | Literal["auto"] | None = None
    tensor_parallel: int = Field(default=1, ge=1)
    pipeline_parallel: int = Field(default=1, ge=1)
    max_model_len: int | None = Field(default=None, ge=16)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    block_size: int = Field(default=16, ge=1)
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    kv_transfer: dict[str, object] | None = Field(default=None, description="engine KV-transfer config for PD")
    lora_modules: dict[str, str] = Field(default_factory=dict)
    api_key: str | None = Field(default=None, description="upstream key (use ${ENV} in YAML)")
    env: dict[str, str] = Field(default_factory=dict)
    extra_args: list[str] = Field(default_factory=list)
    ready_timeout_s: float = Field(default=1200.0, gt=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    preset: str | None = Field(default=None, description="model@hardware for the sim and the latency prior")

    @model_validator(mode="after")
    def _shape(self) -> PoolConfig:
        if self.roles is not None and self.replicas:
            raise ValueError("give either `replicas` or `roles`, not both")
        if self.engine == "openai" and self.launched_replicas:
            raise ValueError("engine `openai` is a remote API: list it under `endpoints`, not replicas")
        if not self.launched_replicas and not self.endpoints:
            raise ValueError("a pool needs launched replicas (`replicas`/`roles`) or static `endpoints`")
        return self

    @property
    def launched_replicas(self) -> int:
        return self.replicas + sum((self.roles or {}).values())

    @property
    def upstream_model(self) -> str:
        """The model name to put in request bodies sent to this pool's engines."""
        return self.served_model_name or self.model

    @property
    def disaggregated(self) -> bool:
        roles = {e.role for e in self.endpoints} | set((self.roles or {}).keys())
        return Role.PREFILL in roles or "prefill" in roles

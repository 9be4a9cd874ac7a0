"""Pool configuration as it appears under `pools:` in gateway.yaml (pydantic: config only).

A pool is a homogeneous group of endpoints serving one public model name: replicas that the
supervisor launches (engine + launch spec) and/or static endpoints (remote vLLM, hosted APIs).
Several pools may serve the same public model (a model group), e.g. local replicas plus a remote
fallback.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from backends.autoscale.config import AutoscaleConfig, ShareConfig
from backends.discovery.slices import DiscoveryConfig
from backends.perf.presets import DEFAULT_PRESET, UnknownPresetError, preset_names, resolve_preset
from backends.perf.roofline import batch_defaults, num_gpu_blocks
from backends.types import Role, Topology

EngineKind = Literal["sim", "vllm", "trtllm", "vllm-ascend", "openai", "anthropic", "bedrock", "gemini", "azure-openai"]

# Hosted providers' own APIs (backends/hosted/ codecs, docs/providers.md): remote, launched never,
# served through the gateway's hosted transport instead of the engine relay.
HOSTED_ENGINES = frozenset({"anthropic", "bedrock", "gemini", "azure-openai"})
# Where a hosted pool sends when it lists no `endpoints` (Azure has no default: the resource's own URL).
DEFAULT_HOSTED_URL: dict[str, str] = {
    "anthropic": "https://api.anthropic.com",
    "gemini": "https://generativelanguage.googleapis.com",
}

# KV block size when a pool omits it. None = the engine chooses and tokenway reads the size it chose
# from its metrics (`vllm:cache_config_info`, TRT-LLM's `tokensPerBlock`): vLLM's attention backends
# accept different sizes per device (the CPU backend only multiples of 32, docs/engines.md), and
# vllm-ascend overrides the value anyway (vllm_ascend/utils.py).
DEFAULT_BLOCK_SIZE_BY_ENGINE: dict[str, int | None] = {
    "sim": 16,
    "vllm": None,
    "trtllm": 32,  # kv_cache_config.tokens_per_block, tensorrt_llm/llmapi/llm_args.py
    "vllm-ascend": None,  # refresh_block_size forces 128 with prefix caching, vllm_ascend/utils.py
    "openai": None,  # a remote API has no visible KV cache
    **{kind: None for kind in HOSTED_ENGINES},
}
# Startup deadlines: big models download, load, compile and capture graphs for many minutes.
DEFAULT_READY_TIMEOUT_S_BY_ENGINE: dict[str, float] = {
    "sim": 120.0,
    "vllm": 1200.0,  # vLLM's own scripts wait 1200 s (disaggregated_serving/kv_events.sh)
    "trtllm": 1800.0,  # TRT-LLM tests allow 900 s for small models (their test_workers.py); engines build longer
    "vllm-ascend": 1800.0,  # ACL-graph capture is slow; Kthena waits 900 s before liveness (using_volcano_kthena.md)
    "openai": 60.0,
    **{kind: 60.0 for kind in HOSTED_ENGINES},
}


# The simulator's own default (`--gpu-memory-utilization`, as vLLM's) and the flags that size it
# differently from the pool's fields: with one of those in `extra_args`, the engine has the last word.
_SIM_GPU_MEMORY_UTILIZATION = 0.92
_SIM_SIZING_FLAGS = frozenset(
    {
        "--preset",
        "-tp",
        "--tensor-parallel-size",
        "--gpu-memory-utilization",
        "--num-gpu-blocks-override",
        "--max-model-len",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TopologyConfig(_Strict):
    """Where an endpoint sits (backends/types.py): the link class of a PD pair's KV transfer."""

    node: str | None = Field(default=None, max_length=253, description="the machine (a Kubernetes node name)")
    rack: str | None = Field(
        default=None, max_length=253, description="the rack or NVLink domain (endpoints sharing its switch)"
    )
    zone: str | None = Field(default=None, max_length=253, description="the zone (topology.kubernetes.io/zone)")

    def labels(self) -> Topology:
        return Topology(node=self.node, rack=self.rack, zone=self.zone)


class StaticEndpointConfig(_Strict):
    """An endpoint the gateway does not launch."""

    url: str = Field(description="base URL without /v1, e.g. http://10.0.0.5:8000")
    role: Role = Field(default=Role.BOTH, description="both, or prefill / decode in a disaggregated pool")
    api_key: str | None = Field(
        default=None, description="bearer key sent to this endpoint (use ${ENV}); default: the pool's"
    )
    api_key_env: str | None = Field(
        default=None,
        description="hosted pools: the environment variable holding this endpoint's own key (another account or "
        "project, balanced with the pool's other endpoints); default: the pool's",
    )
    region: str | None = Field(default=None, description="engine bedrock: this endpoint's region; default: the pool's")
    kv_events_endpoint: str | None = Field(
        default=None,
        description="the engine's ZMQ KV-event socket (tcp://host:port): the precise prefix index follows it",
    )
    kv_events_replay_endpoint: str | None = Field(
        default=None, description="the engine's KV-event replay socket: gaps and late subscriptions repair"
    )
    topology: TopologyConfig | None = Field(
        default=None, description="node / rack / zone: PD pairing prices the KV transfer by link (docs/routing.md)"
    )

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
    enabled: bool = Field(
        default=False,
        description="launched engines publish their KV-cache events (the precise prefix index reads them)",
    )
    port_base: int | None = Field(default=None, description="first ZMQ port; one per replica; auto if null")
    topic: str = Field(default="kv-events", description="ZMQ topic of the events")
    replay: bool = Field(default=True, description="a replay socket per replica, so subscribers can catch up")


class KvStoreConfig(_Strict):
    """A KV store every replica of the pool can read (LMCache's remote backend, Mooncake Store): a block
    it holds is a hit on every replica, loaded at the store's link (docs/routing.md#kv-cache-tiers)."""

    capacity_tokens: int = Field(
        ge=1,
        description="tokens of KV the store holds (least recently used go first); the simulated store's size "
        "(bench/kv_tiers). The precise index follows the store's events; the approximate index (no events) "
        "keeps this many tokens of what was sent to the pool",
    )
    bandwidth_gbps: float = Field(
        default=10.0, gt=0, description="GB/s per device (10^9 bytes/s) of loading KV from the store"
    )
    latency_ms: float = Field(default=1.0, ge=0, description="fixed cost of one load from the store, ms")


class PoolConfig(_Strict):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="unique name of the pool (metrics, logs, routing.pools and flow_control.pools keys)",
    )
    model: str = Field(description="public model name clients send")
    engine: EngineKind = Field(
        default="sim",
        description="what serves the pool: sim (simulated), vllm, trtllm, vllm-ascend, openai (a remote "
        "OpenAI-compatible API), or a hosted provider's own API: anthropic, bedrock, gemini, azure-openai "
        "(docs/providers.md)",
    )
    engine_model: str | None = Field(default=None, description="what the engine loads (HF id / path)")
    served_model_name: str | None = Field(default=None, description="name in upstream request bodies")
    engine_bin: list[str] | None = Field(default=None, description="overrides the engine executable")
    replicas: int = Field(default=0, ge=0, description="launched replicas with role `both`")
    roles: dict[Literal["prefill", "decode"], int] | None = Field(
        default=None, description="launched replicas per PD role (instead of `replicas`)"
    )
    endpoints: list[StaticEndpointConfig] = Field(
        default_factory=list, description="endpoints the gateway does not launch (remote engines, hosted APIs)"
    )
    discovery: DiscoveryConfig | None = Field(
        default=None, description="endpoints found at run time (Kubernetes EndpointSlices), see backends/discovery"
    )
    # launch spec
    topology: TopologyConfig | None = Field(
        default=None,
        description="node / rack / zone of the launched replicas (they run on the gateway's host): PD pairing "
        "prices the KV transfer by link (docs/routing.md)",
    )
    host: str = Field(default="127.0.0.1", description="address launched replicas listen on")
    port_base: int | None = Field(
        default=None, description="first HTTP port of this pool's replicas; default: from backends.port_base"
    )
    devices: list[int] | Literal["auto"] | None = Field(
        default=None, description="accelerators this pool's replicas may use; auto: from the host's budget"
    )
    tensor_parallel: int = Field(default=1, ge=1, description="accelerators per replica (tensor parallel size)")
    pipeline_parallel: int = Field(default=1, ge=1, description="pipeline stages per replica")
    max_model_len: int | None = Field(
        default=None, ge=16, description="context length the engine is started with; default: the model's"
    )
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="passed only when set (vLLM: of total memory; TRT-LLM: of free)"
    )
    block_size: int | None = Field(
        default=None, ge=1, description="KV block size in tokens; default per engine (vLLM: the engine's choice)"
    )
    tokenizer: str | None = Field(
        default=None,
        description="directory (or tokenizer.json) of the model's tokenizer and chat template; default: "
        "`engine_model` when it is a local directory. Also passed to the engine as its tokenizer",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="engines reuse cached prefixes (prefix-aware routing needs it)"
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description="engine batch limit (requests running at once); also read by flow control's reserve",
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="engine token budget per step; default: the engine's"
    )
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    kv_transfer: dict[str, object] | None = Field(default=None, description="engine KV-transfer config for PD")
    kv_store: KvStoreConfig | None = Field(
        default=None,
        description="a KV store shared by the pool's replicas: its blocks count as hits on every replica, priced "
        "at its link (instead of routing.kv_tiers.remote); events of medium other than GPU/CPU/DISK name it",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters the engine loads: name -> path"
    )
    lora_idle_unload_s: float | None = Field(
        default=None,
        gt=0,
        description="LoRA adapters the gateway loaded are unloaded from a replica where they went unused this "
        "long (an adapter's own `idle_unload_s` wins); null: the engine's LRU alone evicts them",
    )
    lora_preload_hottest: int = Field(
        default=0,
        ge=0,
        description="the N LoRA adapters of this pool's model most in demand lately (10-minute half-life) are "
        "loaded on every ready replica and not idle-unloaded; 0: only those marked `preload: true`",
    )
    lora_memory_budget_mb: float | None = Field(
        default=None,
        gt=0,
        description="LoRA adapters registered on one replica stay within this many MB (their `size_mb`, else "
        "their files' size): loading one more unloads the least recently used idle ones first, and an adapter "
        "larger than the budget is refused (400); null: `max_loras` alone bounds a replica",
    )
    api_key: str | None = Field(default=None, description="upstream key (use ${ENV} in YAML)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of launched engines")
    extra_args: list[str] = Field(default_factory=list, description="extra command-line flags of launched engines")
    ready_timeout_s: float = Field(default=1200.0, gt=0, description="startup deadline; default per engine")
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="a stopping replica finishes its requests within this"
    )
    preset: str | None = Field(default=None, description="model@hardware for the sim and the latency prior")
    usd_per_gpu_hour: float | None = Field(
        default=None,
        gt=0,
        description="what one of the pool's accelerators costs per hour, USD: prices the prefill GPU-seconds its "
        "prefix cache saved (tokenway_prefill_saved_usd_total, docs/routing.md); null: not priced",
    )
    priority_scheduling: bool = Field(
        default=True,
        description="engines schedule by request priority (vLLM --scheduling-policy priority, TRT-LLM "
        "waiting_queue_policy: priority); when false the gateway strips `priority` from requests",
    )
    extra_request_fields: list[str] = Field(
        default_factory=list,
        description="engine openai: request fields forwarded besides OpenAI's documented ones (e.g. top_k, "
        "guided_json for an OpenAI-compatible host that accepts them); ['*'] forwards every field",
    )
    # hosted providers (engine anthropic / bedrock / gemini / azure-openai; docs/providers.md)
    api_key_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="hosted pools: the NAME of the environment variable holding the provider's key (never "
        "the key itself); read once at start-up. Bedrock signs with the AWS credential chain instead, "
        "Vertex AI (a `projects/...` model) with Google application default credentials",
    )
    region: str | None = Field(
        default=None,
        pattern=r"^[a-z]{2}(-[a-z]+)+-\d+$",
        description="engine bedrock: the AWS region signed for; its public endpoint is the default URL",
    )
    auth: Literal["key", "entra"] = Field(
        default="key",
        description="engine azure-openai: `entra` sends a Microsoft Entra ID bearer token from azure-identity's "
        "DefaultAzureCredential (the `azure` extra), fetched at start-up and refreshed before it expires, "
        "instead of `api_key_env`'s key",
    )
    api_version: str | None = Field(
        default=None,
        description="hosted pools: anthropic-version (Anthropic), api-version (Azure: a date, or v1), the "
        "API version segment (Gemini); default: the codec's",
    )
    anthropic_beta: list[str] = Field(
        default_factory=list, description="engine anthropic: anthropic-beta values sent with every request"
    )
    allow_dropped_fields: bool = Field(
        default=False,
        description="hosted pools: a request field the provider has no counterpart for is dropped and named "
        "in x-tokenway-dropped-fields, instead of refused with a 400 naming it",
    )
    cache_breakpoints: Literal["off", "auto"] = Field(
        default="off",
        description="engines anthropic and bedrock: `auto` marks the end of the system prompt and of the "
        "conversation for the provider's prompt cache when the client marked nothing (backends/hosted/chat_in.py)",
    )
    cache_breakpoint_min_tokens: int = Field(
        default=1024,
        ge=1,
        description="`auto` marks only parts at least this long (estimated): shorter ones are not cached",
    )
    cache_breakpoint_ttl: Literal["5m", "1h"] | None = Field(
        default=None, description="the marks' cache lifetime; null: the provider's default (5 minutes)"
    )
    first_token_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="hosted pools: a stream that has shown its client nothing this long after the call is cut "
        "and retried on another endpoint of the pool, then the fallback chain; null (default): it waits "
        "as long as the provider takes (a cut call may still be billed by the provider). Engine pools use "
        "`server.first_token_deadline`",
    )
    overflow: bool = Field(
        default=False,
        description="spill-over: the model's other pools come first; this one takes what they cannot "
        "(waiting room over `spill.max_wait_ms`, or a wait worth more than its extra price with "
        "`spill.usd_per_wait_second`, SLO unattainable, down), for tenants whose policy lets them spill",
    )
    engine_config: dict[str, Any] = Field(
        default_factory=dict,
        description="engine-specific settings merged into the adapter's: trtllm-serve --config YAML "
        "(LlmArgs), vllm-ascend --additional-config",
    )
    autoscale: AutoscaleConfig | None = Field(default=None, description="elastic replicas (docs/autoscaling.md)")
    share: ShareConfig | None = Field(default=None, description="take turns on `devices` with other pools")
    migrate_streams: bool | None = Field(
        default=None,
        description="continue a stream on another replica when its own dies or is stopped mid-stream "
        "(default: on for launched pools)",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None, info: ValidationInfo) -> str | None:
        """The simulator and the latency prior both resolve the preset when the pool starts: a name
        they refuse is a configuration error here, at load and in `tokenway check`, not at start-up."""
        if value is None:
            return value
        try:
            resolve_preset(value, info.data.get("tensor_parallel"))
        except UnknownPresetError as exc:
            close = difflib.get_close_matches(value.lower(), preset_names(), n=1, cutoff=0.6)
            raise ValueError(f"{exc}" + (f"; did you mean {close[0]!r}?" if close else "")) from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            engine = data.get("engine", "sim")
            if engine in DEFAULT_BLOCK_SIZE_BY_ENGINE:
                data = dict(data)
                data.setdefault("block_size", DEFAULT_BLOCK_SIZE_BY_ENGINE[engine])
                data.setdefault("ready_timeout_s", DEFAULT_READY_TIMEOUT_S_BY_ENGINE[engine])
            if engine in HOSTED_ENGINES and not data.get("endpoints"):
                url = _default_hosted_url(engine, data)
                if url is not None:
                    data = {**data, "endpoints": [{"url": url}]}
        return data

    @model_validator(mode="after")
    def _shape(self) -> PoolConfig:
        if self.roles is not None and self.replicas:
            raise ValueError("give either `replicas` or `roles`, not both")
        if self.engine == "openai" and self.launched_replicas:
            raise ValueError("engine `openai` is a remote API: list it under `endpoints`, not replicas")
        self._check_hosted()
        if self.extra_request_fields and self.engine != "openai":
            raise ValueError(
                f"extra_request_fields only applies to engine `openai` ({self.engine!r} forwards what it accepts)"
            )
        if self.autoscale is not None:
            self._check_autoscale(self.autoscale)
        elif self.share is not None:
            raise ValueError("`share` needs `autoscale` (sharing pools sleep and wake their replicas)")
        if not self.launched_replicas and not self.endpoints and self.discovery is None and self.autoscale is None:
            raise ValueError(
                "a pool needs launched replicas (`replicas`/`roles`, or `autoscale`), static `endpoints` or `discovery`"
            )
        self._check_simulated()
        return self

    def _check_hosted(self) -> None:
        """A hosted pool is remote, keyed by an environment variable's name, and takes the provider
        fields only where they mean something: a misplaced one is a configuration error, not ignored."""
        hosted = self.engine in HOSTED_ENGINES
        if not hosted:
            for name in ("api_key_env", "region", "api_version"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"`{name}` applies to hosted engines only (anthropic, bedrock, gemini, azure-openai)"
                    )
            if self.anthropic_beta or self.allow_dropped_fields:
                raise ValueError("`anthropic_beta` / `allow_dropped_fields` apply to hosted engines only")
            if self.auth != "key":
                raise ValueError("`auth: entra` applies to engine `azure-openai` only")
            if self.cache_breakpoints != "off":
                raise ValueError("`cache_breakpoints` applies to engines anthropic and bedrock only")
            if self.first_token_timeout_s is not None:
                raise ValueError(
                    "`first_token_timeout_s` applies to hosted engines (engines: server.first_token_deadline)"
                )
            if any(e.api_key_env is not None or e.region is not None for e in self.endpoints):
                raise ValueError("an endpoint's `api_key_env` / `region` apply to hosted engines only")
            return
        engine = self.engine
        if self.launched_replicas or self.autoscale is not None or self.discovery is not None:
            raise ValueError(
                f"engine `{engine}` is a hosted API: it launches nothing (give `endpoints` or the defaults)"
            )
        if self.api_key is not None or any(e.api_key is not None for e in self.endpoints):
            raise ValueError(f"engine `{engine}`: name the key's environment variable in `api_key_env`, not the key")
        if any(e.role is not Role.BOTH for e in self.endpoints) or any(e.kv_events_endpoint for e in self.endpoints):
            raise ValueError(f"engine `{engine}` has no prefill/decode roles or KV events")
        if engine == "bedrock":
            if self.region is None and (not self.endpoints or any(e.region is None for e in self.endpoints)):
                raise ValueError("engine `bedrock` needs `region` (SigV4 signs for it)")
            if self.api_key_env is not None or any(e.api_key_env is not None for e in self.endpoints):
                raise ValueError("engine `bedrock` signs with the AWS credential chain: no `api_key_env`")
        elif self.region is not None or any(e.region is not None for e in self.endpoints):
            raise ValueError("`region` applies to engine `bedrock` only")
        if self.anthropic_beta and engine != "anthropic":
            raise ValueError("`anthropic_beta` applies to engine `anthropic` only")
        if self.cache_breakpoints != "off" and engine not in ("anthropic", "bedrock"):
            raise ValueError(
                f"`cache_breakpoints` applies to engines anthropic and bedrock only (`{engine}` caches on its own)"
            )
        if engine == "azure-openai" and not self.endpoints:
            raise ValueError(
                "engine `azure-openai` needs `endpoints` (the resource's URL, https://NAME.openai.azure.com)"
            )
        if self.auth == "entra":
            if engine != "azure-openai":
                raise ValueError("`auth: entra` applies to engine `azure-openai` only")
            if self.api_key_env is not None or any(e.api_key_env is not None for e in self.endpoints):
                raise ValueError("`auth: entra` sends an Entra ID token: no `api_key_env`")
        vertex = engine == "gemini" and self.upstream_model.startswith("projects/")
        entra = engine == "azure-openai" and self.auth == "entra"
        keyed = (
            (engine == "anthropic") or (engine == "azure-openai" and not entra) or (engine == "gemini" and not vertex)
        )
        if keyed and self.api_key_env is None and any(e.api_key_env is None for e in self.endpoints):
            raise ValueError(f"engine `{engine}` needs `api_key_env` (the environment variable holding the key)")

    @property
    def hosted(self) -> bool:
        """Served through a hosted provider's own API (the hosted transport), not an engine's."""
        return self.engine in HOSTED_ENGINES

    def _check_simulated(self) -> None:
        """A launched simulated engine refuses to start where vLLM would (the model does not fit the
        devices, `max_model_len` is over what the KV cache holds); the same performance model says so
        here, at load and in `tokenway check`, instead of a replica that never becomes ready."""
        if self.engine != "sim" or (not self.launched_replicas and self.autoscale is None):
            return
        if any(arg.split("=", 1)[0] in _SIM_SIZING_FLAGS for arg in self.extra_args):
            return  # sized by its own flags: the engine itself reports
        name = self.preset or self.env.get("TOKENWAY_SIM_PRESET") or os.environ.get("TOKENWAY_SIM_PRESET")
        preset = resolve_preset(name or DEFAULT_PRESET, self.tensor_parallel)
        default_seqs, default_tokens = batch_defaults(preset)
        block_size = self.block_size or DEFAULT_BLOCK_SIZE_BY_ENGINE["sim"] or 16
        try:
            blocks = num_gpu_blocks(
                preset,
                block_size,
                self.gpu_memory_utilization or _SIM_GPU_MEMORY_UTILIZATION,
                self.max_num_batched_tokens or default_tokens,
                self.max_num_seqs or default_seqs,
            )
        except ValueError as exc:
            raise ValueError(f"the simulated engine would refuse to start: {exc}") from None
        capacity = blocks * block_size
        if self.max_model_len is not None and self.max_model_len > capacity:
            raise ValueError(
                f"the simulated engine would refuse to start: max_model_len {self.max_model_len} is larger than "
                f"the KV cache of {preset.name} holds ({capacity} tokens)"
            )

    def _check_autoscale(self, autoscale: AutoscaleConfig) -> None:
        if self.engine == "openai":
            raise ValueError("engine `openai` is a remote API: it cannot be autoscaled")
        if self.discovery is not None:
            raise ValueError("`autoscale` sizes launched replicas; a pool with `discovery` is sized by its cluster")
        if self.roles is not None and autoscale.roles is None:
            raise ValueError("a prefill/decode pool's `autoscale` needs `roles` bounds per role")
        if self.roles is None and autoscale.roles is not None:
            raise ValueError("`autoscale.roles` needs `roles` (a prefill/decode pool)")
        for role, count in self.initial_roles().items():
            _low, high = autoscale.bounds(role)
            if count > high:
                raise ValueError(f"{count} initial {role} replicas but autoscale allows at most {high}")
        if self.share is not None and not isinstance(self.devices, list):
            raise ValueError("`share` needs the shared `devices` listed")

    def initial_roles(self) -> dict[str, int]:
        """Launched replicas per role at start ("both" for an ordinary pool); an autoscaled pool starts
        at least its `min_replicas`."""
        counts: dict[str, int] = {"both": self.replicas}
        if self.roles is not None:
            counts = {str(role): int(n) for role, n in self.roles.items()}
        if self.autoscale is not None:
            for role in list(counts):
                low, high = self.autoscale.bounds(role)
                counts[role] = min(max(counts[role], low), max(high, counts[role]))
        return counts

    def slots(self, role: str) -> int:
        """Replica slots (ids, ports) planned for `role`: the initial count, or the autoscaler's maximum
        (its surge included)."""
        initial = self.initial_roles().get(role, 0)
        if self.autoscale is None:
            return initial
        return max(initial, self.autoscale.ceiling(role))

    @property
    def migrates_streams(self) -> bool:
        """Whether a stream cut by its replica continues on another (default: on for launched pools)."""
        if self.migrate_streams is not None:
            return self.migrate_streams
        return self.engine != "openai" and self.engine not in HOSTED_ENGINES

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

    @property
    def elastic(self) -> bool:
        """Whether the autoscaler sizes this pool's launched replicas."""
        return self.autoscale is not None


def _default_hosted_url(engine: str, data: dict[str, Any]) -> str | None:
    """A hosted pool's endpoint when it lists none: the provider's public API (Bedrock's in `region`,
    Vertex AI's in the model's location), as backends/hosted/ writes it; None where there is none."""
    if engine == "bedrock":
        region = data.get("region")
        return f"https://bedrock-runtime.{region}.amazonaws.com" if isinstance(region, str) else None
    if engine == "gemini":
        model = data.get("served_model_name") or data.get("model")
        if isinstance(model, str) and model.startswith("projects/"):
            parts = model.split("/")
            location = parts[3] if len(parts) > 3 and parts[2] == "locations" else "global"
            return (
                "https://aiplatform.googleapis.com"
                if location == "global"
                else f"https://{location}-aiplatform.googleapis.com"
            )
    return DEFAULT_HOSTED_URL.get(engine)


class EjectionSettings(_Strict):
    """Passive health: consecutive connect errors / 5xx eject an endpoint for a cooldown.

    As Envoy's outlier detection caps ejections (`max_ejection_percent`) so that a fault everyone
    shares (an overload, a client's poison request) cannot empty the pool: past the cap, or for the
    last endpoint still in, an ejection is withheld and the endpoint keeps serving.
    """

    consecutive_failures: int = Field(default=3, ge=1, description="failures in a row that eject")
    cooldown_s: float = Field(default=5.0, gt=0, description="first ejection; doubles per failed probe")
    max_cooldown_s: float = Field(default=60.0, gt=0, description="the ejection cooldown stops doubling here")
    max_ejection_percent: float = Field(
        default=50.0,
        ge=0,
        le=100,
        description="most of a pool's endpoints (per role) ejected at once; one may always go, the last never",
    )


class BackendsSettings(_Strict):
    """The `backends:` section of gateway.yaml: how the supervisor launches and watches engines.

    The supervisor launches replicas on the host the gateway runs on; `devices` are that host's
    accelerators (GPU indices for CUDA engines, NPU ids for vllm-ascend). Relative paths are relative
    to the gateway's working directory.
    """

    devices: list[int] | Literal["auto"] = Field(
        default="auto", description="this host's accelerators; auto = nvidia-smi / npu-smi when present"
    )
    port_base: int = Field(default=8100, ge=1, le=65535, description="first automatic HTTP port")
    kv_events_port_base: int = Field(default=5557, ge=1, le=65535, description="first automatic ZMQ port")
    kv_events_replay_port_base: int = Field(
        default=5657, ge=1, le=65535, description="first automatic KV-event replay port"
    )
    kv_transfer_port_base: int = Field(
        default=5600, ge=1, le=65535, description="first automatic KV-transfer side-channel port"
    )
    log_dir: str = Field(default="var/log/engines", description="one log file per replica")
    run_dir: str = Field(default="var/run/engines", description="generated engine config files")
    hash_seed: str = Field(
        default="0", description="PYTHONHASHSEED of vLLM engines: identical prefix hashes on every replica"
    )
    scrape_interval_s: float = Field(default=0.25, gt=0, description="metrics polling per endpoint")
    lora_discovery_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="GET /v1/models of vLLM endpoints serving an adapter's base model: the LoRA adapters each "
        "holds (docs/adapters.md)",
    )
    scrape_timeout_s: float = Field(
        default=1.0, gt=0, description="one metrics scrape; a slower engine keeps its last stats"
    )
    stats_max_age_s: float = Field(default=2.0, gt=0, description="older stats count as saturated")
    health_interval_s: float = Field(default=1.0, gt=0, description="active checks of local engines")
    remote_health_interval_s: float = Field(default=30.0, gt=0, description="active checks of remote APIs")
    health_timeout_s: float = Field(default=2.0, gt=0, description="one health check; slower counts as a failure")
    ready_poll_interval_s: float = Field(default=1.0, gt=0, description="/health polling while starting")
    restart_backoff_s: float = Field(default=1.0, ge=0, description="first restart delay; doubles per crash")
    restart_backoff_max_s: float = Field(default=60.0, ge=0, description="the restart delay stops doubling here")
    crash_loop_restarts: int = Field(default=5, ge=1, description="exits within the window = crash loop")
    crash_loop_window_s: float = Field(
        default=300.0, gt=0, description="window of crash_loop_restarts; a crash-looping replica is left stopped"
    )
    term_grace_s: float = Field(default=15.0, ge=0, description="SIGTERM -> SIGKILL")
    log_tail_lines: int = Field(default=30, ge=1, description="log lines shown when a replica fails")
    ejection: EjectionSettings = Field(default_factory=EjectionSettings)

"""Everything one simulated engine instance is configured with, and vLLM's defaults for it."""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from backends.perf import roofline
from backends.perf.hardware import GIB
from backends.perf.presets import Preset, resolve_preset
from backends.perf.roofline import batch_defaults, kv_bytes_per_token_per_device, num_gpu_blocks
from backends.types import LINK_CLASSES, UNKNOWN, Topology

log = logging.getLogger("tokenway.sim")

VLLM_VERSION = "0.33.0"


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's --kv-events-config (vllm/config/kv_events.py), plus `format` for the older shape."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    topic: str = ""
    format: str = "tagged"  # "tagged" (0.33 maps with "type") or "positional" (older arrays)

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> KVEventsConfig | None:
        if text is None:
            return None
        data = json.loads(text) if isinstance(text, str) else dict(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        config = cls(**known)
        return config if config.enable_kv_cache_events else None


DEFAULT_STORE_DRAM_GIB = 1.0  # the DRAM tier of an engine given a store and no --kv-offloading-size


@dataclass(slots=True)
class EngineConfig:
    preset: Preset
    model: str
    served_model_names: list[str]
    max_model_len: int
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool = True
    kv_events: KVEventsConfig | None = None
    kv_transfer: dict[str, Any] | None = None
    engine_id: str = field(default_factory=lambda: f"sim-{uuid.uuid4().hex[:12]}")
    seed: int = 0
    output_len_mean: float = 200.0
    time_scale: float = 1.0
    kv_transfer_bandwidth: float = 25e9  # bytes/s of the PD link (every link, unless `kv_link_bandwidth` names it)
    # where this engine sits (node / rack / zone) and bytes/s per link class (backends.types.LINK_CLASSES):
    # a decode leg's pull runs at the class of the link to the prefill engine's labels
    topology: Topology = UNKNOWN
    kv_link_bandwidth: dict[str, float] = field(default_factory=dict)
    kv_lease_s: float = 30.0
    kv_offload_blocks: int = 0  # host-DRAM tier below HBM, in blocks (vLLM's --kv-offloading-size); 0: none
    kv_offload_bandwidth: float = 25e9  # bytes/s per device between host DRAM and HBM (PCIe)
    kv_store_url: str | None = None  # a store shared with other engine processes (sim/kv_store.py)
    api_key: str | None = None
    embedding_dim: int = 256  # /v1/embeddings vectors when the request names no `dimensions`
    enable_sleep_mode: bool = False  # vLLM's --enable-sleep-mode
    server_dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: development routes (/sleep, /wake_up, ...)
    load_bandwidth: float = roofline.DEFAULT_LOAD_BANDWIDTH  # bytes/s: start-up and level-2 wake reloads
    startup_s: float = 0.0  # simulated seconds from launch to listening (0: start at once)
    # tests only: a generation request whose body holds this text answers 500 (an engine that fails on it)
    fail_on_marker: str | None = None
    # LoRA (sim/lora.py): vLLM's --enable-lora, --max-loras, --lora-modules; the adapters' load bandwidth
    enable_lora: bool = False
    max_loras: int = 1
    lora_modules: dict[str, str] = field(default_factory=dict)
    lora_load_bandwidth: float = 1e9
    lora_memory_budget: int | None = None  # bytes of adapters on the GPU besides max_loras (None: slots alone)

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]


def build_engine_config(
    preset: str | Preset = "llama-3.1-8b@h100",
    *,
    tp: int | None = None,
    model: str | None = None,
    served_model_names: list[str] | None = None,
    max_model_len: int | None = None,
    block_size: int = 16,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    gpu_memory_utilization: float = 0.92,
    num_gpu_blocks_override: int | None = None,
    enable_prefix_caching: bool = True,
    kv_events_config: str | dict[str, Any] | KVEventsConfig | None = None,
    kv_transfer_config: str | dict[str, Any] | None = None,
    seed: int = 0,
    output_len_mean: float = 200.0,
    time_scale: float = 1.0,
    kv_transfer_bandwidth_gbps: float = 25.0,
    topology: str | Topology | None = None,
    kv_link_bandwidth_gbps: str | dict[str, float] | None = None,
    kv_offloading_size_gib: float | None = None,
    kv_offload_bandwidth_gbps: float = 25.0,
    kv_store_url: str | None = None,
    api_key: str | None = None,
    embedding_dim: int = 256,
    fail_on_marker: str | None = None,
    enable_sleep_mode: bool = False,
    server_dev_mode: bool | None = None,
    simulate_startup: bool = False,
    load_bandwidth_gbps: float | None = None,
    init_s: float | None = None,
    load_format: str = "auto",
    enable_lora: bool = False,
    max_loras: int = 1,
    lora_modules: dict[str, str] | None = None,
    lora_load_bandwidth_gbps: float = 1.0,
    lora_memory_budget_mb: float | None = None,
) -> EngineConfig:
    """Resolve a preset and vLLM-style options into an EngineConfig, applying vLLM's defaults.

    `server_dev_mode` None reads ``VLLM_SERVER_DEV_MODE`` as vLLM does. With `simulate_startup` the
    engine listens only after `roofline.startup_s` simulated seconds (weights at the load bandwidth,
    none with `load_format="dummy"`, plus `init_s`); without it, at once, as tests want.

    `kv_offloading_size_gib` (vLLM's `--kv-offloading-size`, GiB of host memory per engine) adds the
    host-DRAM tier (`HostOffload`, kv_cache.py), reached at `kv_offload_bandwidth_gbps` (GB/s per device).

    `kv_store_url` shares a KV store with other engine processes (`sim/kv_store.py`); an engine given
    one without a DRAM tier gets `DEFAULT_STORE_DRAM_GIB` of it (the store is read after that tier).

    `topology` (`node=N,rack=R,zone=Z`) places the engine; `kv_link_bandwidth_gbps`
    (`same_rack=50,cross_rack=5`, GB/s per link class) prices a PD pull by the link between the two
    engines' labels (`backends.types.link_class`), `kv_transfer_bandwidth_gbps` where the class is not
    named or either engine has no labels.

    Raises ValueError where vLLM would refuse to start (model does not fit, max_model_len over
    the KV capacity).
    """
    resolved = preset if isinstance(preset, Preset) else resolve_preset(preset, tp)
    default_seqs, default_tokens = batch_defaults(resolved)
    seqs = max_num_seqs or default_seqs
    batched = max_num_batched_tokens or default_tokens
    blocks = num_gpu_blocks_override or num_gpu_blocks(resolved, block_size, gpu_memory_utilization, batched, seqs)
    capacity = blocks * block_size
    if max_model_len is None:
        max_model_len = min(resolved.model.max_model_len, capacity)
    elif max_model_len > capacity and num_gpu_blocks_override:
        log.warning("max_model_len %d capped to the %d tokens of %d overridden blocks", max_model_len, capacity, blocks)
        max_model_len = capacity
    elif max_model_len > capacity:
        raise ValueError(
            f"max_model_len {max_model_len} is larger than the KV cache can hold ({capacity} tokens); "
            "decrease max_model_len or increase gpu_memory_utilization"
        )
    model_id = model or resolved.model.hf_id
    names = served_model_names or [model_id]
    if isinstance(kv_events_config, KVEventsConfig):
        events = kv_events_config if kv_events_config.enable_kv_cache_events else None
    else:
        events = KVEventsConfig.from_json(kv_events_config)
    transfer = json.loads(kv_transfer_config) if isinstance(kv_transfer_config, str) else kv_transfer_config
    load_bandwidth = roofline.DEFAULT_LOAD_BANDWIDTH if load_bandwidth_gbps is None else load_bandwidth_gbps * 1e9
    if load_bandwidth <= 0:
        raise ValueError("the load bandwidth must be > 0")
    startup = 0.0
    if simulate_startup:
        init = roofline.DEFAULT_INIT_S if init_s is None else init_s
        startup = roofline.startup_s(resolved, load_bandwidth, init, load_weights=load_format != "dummy")
    offload_blocks = 0
    if kv_store_url and not kv_offloading_size_gib:  # the store is read after a DRAM tier: give it one
        kv_offloading_size_gib = DEFAULT_STORE_DRAM_GIB
    if kv_offloading_size_gib:
        if kv_offload_bandwidth_gbps <= 0:
            raise ValueError("the KV offload bandwidth must be > 0")
        offload_blocks = int(kv_offloading_size_gib * GIB) // (block_size * kv_bytes_per_token_per_device(resolved))
    if server_dev_mode is None:
        server_dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true")
    config = EngineConfig(
        preset=resolved,
        model=model_id,
        served_model_names=names,
        max_model_len=max_model_len,
        num_gpu_blocks=blocks,
        block_size=block_size,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=enable_prefix_caching,
        kv_events=events,
        kv_transfer=transfer,
        seed=seed,
        output_len_mean=output_len_mean,
        time_scale=time_scale,
        kv_transfer_bandwidth=kv_transfer_bandwidth_gbps * 1e9,
        topology=parse_topology(topology),
        kv_link_bandwidth=parse_link_bandwidths(kv_link_bandwidth_gbps),
        kv_offload_blocks=offload_blocks,
        kv_offload_bandwidth=kv_offload_bandwidth_gbps * 1e9,
        kv_store_url=kv_store_url or None,
        api_key=api_key,
        embedding_dim=embedding_dim,
        fail_on_marker=fail_on_marker or None,
        enable_sleep_mode=enable_sleep_mode,
        server_dev_mode=server_dev_mode,
        load_bandwidth=load_bandwidth,
        startup_s=startup,
        enable_lora=enable_lora or bool(lora_modules),
        max_loras=max_loras,
        lora_modules=dict(lora_modules or {}),
        lora_load_bandwidth=lora_load_bandwidth_gbps * 1e9,
        lora_memory_budget=int(lora_memory_budget_mb * 1024 * 1024) if lora_memory_budget_mb is not None else None,
    )
    if max_loras < 1 or lora_load_bandwidth_gbps <= 0:
        raise ValueError("--max-loras must be >= 1 and --lora-load-bandwidth-gbps > 0")
    if lora_memory_budget_mb is not None and lora_memory_budget_mb <= 0:
        raise ValueError("--lora-memory-budget-mb must be > 0")
    if transfer:
        extra = transfer.get("kv_connector_extra_config") or {}
        config.kv_lease_s = float(extra.get("kv_lease_duration", config.kv_lease_s))
        if transfer.get("engine_id"):
            config.engine_id = str(transfer["engine_id"])
    return config


def parse_topology(value: str | Topology | None) -> Topology:
    """`node=N,rack=R,zone=Z` (any subset) -> Topology; None or empty: no labels."""
    if isinstance(value, Topology):
        return value
    labels: dict[str, str] = {}
    for part in (value or "").split(","):
        if not part.strip():
            continue
        name, sep, label = part.partition("=")
        name = name.strip()
        if not sep or name not in ("node", "rack", "zone") or not label.strip():
            raise ValueError(f"topology: expected node=..., rack=..., zone=..., got {part!r}")
        labels[name] = label.strip()
    return Topology(**labels)


def parse_link_bandwidths(value: str | dict[str, float] | None) -> dict[str, float]:
    """`same_rack=50,cross_rack=5` (GB/s per link class) -> {class: bytes/s}."""
    pairs: list[tuple[str, float]] = []
    if isinstance(value, dict):
        pairs = [(k, float(v)) for k, v in value.items()]
    else:
        for part in (value or "").split(","):
            if not part.strip():
                continue
            name, sep, number = part.partition("=")
            if not sep:
                raise ValueError(f"kv link bandwidth: expected CLASS=GBPS, got {part!r}")
            pairs.append((name.strip(), float(number)))
    out: dict[str, float] = {}
    for name, gbps in pairs:
        if name not in LINK_CLASSES:
            raise ValueError(f"kv link bandwidth: unknown link class {name!r} (one of {', '.join(LINK_CLASSES)})")
        if gbps <= 0:
            raise ValueError(f"kv link bandwidth: {name} must be > 0 GB/s")
        out[name] = gbps * 1e9
    return out

"""vLLM and the engines that speak its protocol: vLLM itself, vllm-ascend, and the simulated engine;
and the priority mapping every engine with priority scheduling shares.

vLLM
----
vLLM (V1 engine): `vllm serve`, `/health`, `vllm:*` Prometheus metrics, NIXL PD handshake.

Checked against a real `vllm serve` (the CPU build 0.32.0, `make test-vllm`): every argv this adapter
emits parses with vLLM's own argument parser, and the metrics below are read from a live engine.
Facts from vLLM 0.33.0's source (each comment names its file) and the real CPU engine (docs/engines.md).
vllm-ascend and the simulated engine speak the same protocol and reuse this class with other defaults.

vllm-ascend
-----------
vllm-ascend: `vllm serve` on Ascend NPUs. Same HTTP API, `/health` and `vllm:*` metrics as vLLM
(it is a platform plugin, pinned to vLLM v0.27.1); facts from vllm-ascend's source (`vllm-project/vllm-ascend`).

Differences from vLLM: devices through `ASCEND_RT_VISIBLE_DEVICES`, block size 128 by default,
Ascend options through `--additional-config` (the pool's `engine_config`), PD through Mooncake
connectors, and a prefill leg that also sets `min_tokens=1`.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.adapters.base import (
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
from backends.config import PoolConfig
from backends.types import EndpointStats, MetricsFormatError, Role

# Metric names, new first, then the pre-0.10 names they replaced (vllm/v1/metrics/loggers.py; removal
# policy in vllm/config/observability.py). Counters appear with `_total` in the text format; some exporters omit it.
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_HITS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits",
)
PREFIX_QUERIES = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries",
)
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
CACHE_CONFIG = ("vllm:cache_config_info",)
# New in 0.32 (docs/engines.md): waiting split by reason (`capacity` / `deferred`), the prompt tokens
# served from cache (the engine's own count of what requests report as `cached_tokens`), and the
# sleep state (`awake` / `weights_offloaded` / `discard_all`, one series per state, 1 = current).
WAITING_BY_REASON = ("vllm:num_requests_waiting_by_reason",)
PROMPT_TOKENS = ("vllm:prompt_tokens_total", "vllm:prompt_tokens")
PROMPT_TOKENS_CACHED = ("vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_cached")
SLEEP_STATE = ("vllm:engine_sleep_state",)
# LoRA: one series, labels `max_lora`, `running_lora_adapters`, `waiting_lora_adapters` (comma-separated
# adapter names), value the time it was set (vLLM docs, design/metrics: "vllm:lora_requests_info");
# the latest series wins when several are exported
LORA_INFO = ("vllm:lora_requests_info",)
# The offloading connector's traffic (`--kv-offloading-size`): bytes per `transfer_type` (source medium
# `_to_` destination, e.g. GPU_to_CPU), vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py
KV_OFFLOAD_BYTES = ("vllm:kv_offload_total_bytes_total", "vllm:kv_offload_total_bytes")
WANTED = frozenset(
    RUNNING
    + WAITING
    + KV_USAGE
    + PREFIX_HITS
    + PREFIX_QUERIES
    + PREEMPTIONS
    + CACHE_CONFIG
    + WAITING_BY_REASON
    + PROMPT_TOKENS
    + PROMPT_TOKENS_CACHED
    + SLEEP_STATE
    + LORA_INFO
    + KV_OFFLOAD_BYTES
)

# Prefill leg of the NIXL pull handshake (vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py).
PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def clamp_priority(value: Any) -> int | None:
    """tokenway priority as an int within [PRIORITY_MIN, PRIORITY_MAX]; None when not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return max(PRIORITY_MIN, min(PRIORITY_MAX, round(value)))


def wants_priority(pool: PoolConfig | None) -> bool:
    return pool is None or pool.priority_scheduling


@dataclass(frozen=True, slots=True)
class VllmAdapter:
    """`vllm serve` with CUDA devices. Parameters let vllm-ascend and the sim reuse it."""

    kind: str = "vllm"
    executable: tuple[str, ...] = ("vllm",)
    launches: bool = True
    uses_devices: bool = True
    device_env: str | None = "CUDA_VISIBLE_DEVICES"  # vllm/envs.py
    device_tool: str | None = "nvidia-smi"
    supports_pd: bool = True
    health_path: str = "/health"  # 200 ready, 503 engine dead (vllm/entrypoints/serve/instrumentator/)
    metrics_paths: tuple[str, ...] = ("/metrics",)
    kv_events_port_needed: bool = True
    kv_transfer_port_needed: bool = True
    discovers_model_name: bool = False
    default_kv_connector: str = "NixlConnector"  # vLLM docs/features/nixl_connector_usage.md
    prefill_min_tokens: int | None = None  # vllm-ascend's P leg sets min_tokens=1 (its mooncake_connector.py)

    # --- launching -------------------------------------------------------------------------------

    def validate(self, pool: PoolConfig) -> list[str]:
        problems = []
        if pool.engine_config:
            problems.append(f"engine `{self.kind}` takes no `engine_config`; use `extra_args` for flags")
        problems += self.validate_kv_events_host(pool)
        return problems

    def validate_kv_events_host(self, pool: PoolConfig) -> list[str]:
        if pool.kv_events.enabled and self.kv_events_port_needed and zmq_bind_host(pool.host) is None:
            return [
                f"kv_events need `host` as an IP address or localhost (got {pool.host!r}): vLLM binds its "
                "KV-event socket only on `*` or an address containing `::` (see docs/engines.md)"
            ]
        return []

    def served_model(self, pool: PoolConfig) -> str:
        return pool.upstream_model

    def command(self, pool: PoolConfig) -> list[str]:
        """The executable and subcommand; `engine_bin` replaces the executable."""
        return [*(pool.engine_bin or self.executable), "serve"]

    def launch_spec(self, pool: PoolConfig, replica: ReplicaPlan) -> LaunchSpec:
        argv = [*self.command(pool), pool.engine_model or pool.model]  # positional model (entrypoints/cli/serve.py)
        argv += ["--served-model-name", self.served_model(pool)]
        argv += ["--host", replica.host, "--port", str(replica.port)]
        argv += ["--tensor-parallel-size", str(pool.tensor_parallel)]
        argv += ["--pipeline-parallel-size", str(pool.pipeline_parallel)]
        if pool.max_model_len:
            argv += ["--max-model-len", str(pool.max_model_len)]
        if pool.tokenizer:
            argv += ["--tokenizer", pool.tokenizer]  # the gateway counts with the same files
        if pool.gpu_memory_utilization is not None:  # else vLLM's own default (0.92 in 0.32, vllm/config/cache.py)
            argv += ["--gpu-memory-utilization", _num(pool.gpu_memory_utilization)]
        if pool.block_size is not None:
            # Only when the pool sets one: vLLM's CPU attention accepts only multiples of 32 (docs/engines.md), and
            # the size the engine chose is read back from vllm:cache_config_info.
            argv += ["--block-size", str(pool.block_size)]
        # `usage.prompt_tokens_details.cached_tokens` is null without it (docs/engines.md): cached input is billed.
        argv.append("--enable-prompt-tokens-details")
        argv.append("--enable-prefix-caching" if pool.enable_prefix_caching else "--no-enable-prefix-caching")
        if pool.max_num_seqs:
            argv += ["--max-num-seqs", str(pool.max_num_seqs)]
        if pool.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(pool.max_num_batched_tokens)]
        if pool.priority_scheduling:
            # Request `priority` other than 0 is an error under fcfs (vllm/config/scheduler.py).
            argv += ["--scheduling-policy", "priority"]
        events = self.kv_events_config(pool, replica)
        if events is not None:
            argv += ["--kv-events-config", _json(events)]
        transfer = self.kv_transfer_config(pool, replica)
        if transfer is not None:
            argv += ["--kv-transfer-config", _json(transfer)]
        if pool.lora_modules:
            argv += ["--enable-lora", "--lora-modules"]
            argv += [f"{name}={path}" for name, path in pool.lora_modules.items()]
        argv += self.platform_args(pool, replica)
        argv += pool.extra_args
        return LaunchSpec(
            argv=tuple(argv),
            env={**self.engine_env(pool, replica), **pool.env},
            log_path=replica.log_path,
            secret_env=frozenset({"VLLM_API_KEY"}),
        )

    def platform_args(self, pool: PoolConfig, replica: ReplicaPlan) -> list[str]:
        """Flags a platform variant adds after the common ones."""
        return []

    def engine_env(self, pool: PoolConfig, replica: ReplicaPlan) -> dict[str, str]:
        env: dict[str, str] = {}
        if replica.devices and self.device_env:
            env[self.device_env] = ",".join(str(d) for d in replica.devices)
        # Same NONE_HASH on every replica so prefix-block hashes agree (vllm/v1/core/kv_cache_utils.py).
        env["PYTHONHASHSEED"] = replica.hash_seed
        env["VLLM_NO_USAGE_STATS"] = "1"  # no phone-home from a gateway-managed engine (vllm/envs.py)
        if pool.lora_modules or "--enable-lora" in pool.extra_args:
            # the gateway loads adapters on demand through /v1/load_lora_adapter (docs/adapters.md), which
            # vLLM serves only with this set (docs.vllm.ai, "LoRA Adapters", dynamically serving adapters)
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if pool.api_key:
            # Through the environment, not --api-key, so the key is not visible in `ps` (vllm/envs.py).
            env["VLLM_API_KEY"] = pool.api_key
        transfer = self.kv_transfer_config(pool, replica)
        if transfer is not None and transfer.get("kv_connector") == "NixlConnector":
            # Distinct side channel per instance (vLLM docs/features/nixl_connector_usage.md).
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = connect_host(replica.host)
            if replica.kv_transfer_port is not None:
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(replica.kv_transfer_port)
        return env

    def kv_events_config(self, pool: PoolConfig, replica: ReplicaPlan) -> dict[str, Any] | None:
        if not pool.kv_events.enabled or replica.kv_events_port is None:
            return None
        # Field names from vllm/config/kv_events.py. The publisher binds only an
        # endpoint containing `*` or `::` (docs/engines.md), so the engine's own address is written in its
        # IPv4-mapped IPv6 form: bound on that address alone, not on every interface.
        host = zmq_bind_host(replica.host)
        config: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{host}:{replica.kv_events_port}",
        }
        if replica.kv_events_replay_port is not None:
            config["replay_endpoint"] = f"tcp://{host}:{replica.kv_events_replay_port}"
        config["topic"] = pool.kv_events.topic
        return config

    def kv_events_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        if not pool.kv_events.enabled or replica.kv_events_port is None:
            return None
        return f"tcp://{connect_host(replica.host)}:{replica.kv_events_port}"

    def kv_events_replay_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        if self.kv_events_endpoint(pool, replica) is None or replica.kv_events_replay_port is None:
            return None
        return f"tcp://{connect_host(replica.host)}:{replica.kv_events_replay_port}"

    def kv_transfer_config(self, pool: PoolConfig, replica: ReplicaPlan) -> dict[str, Any] | None:
        """--kv-transfer-config for PD roles (vllm/config/kv_transfer.py, docs/features/nixl_connector_usage.md)."""
        if replica.role is Role.BOTH and pool.kv_transfer is None:
            return None
        config: dict[str, Any] = dict(pool.kv_transfer or {})
        connector = config.setdefault("kv_connector", self.default_kv_connector)
        if "kv_role" not in config:
            config["kv_role"] = self.kv_role(connector, replica.role)
        if connector != "NixlConnector" and replica.kv_transfer_port is not None:
            config.setdefault("kv_port", replica.kv_transfer_port)
        return config

    def kv_role(self, connector: str, role: Role) -> str:
        if connector == "NixlConnector":
            return "kv_both"  # NIXL's role is a placeholder on both sides (nixl_connector_usage.md)
        return {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}.get(role, "kv_both")

    # --- readiness and metrics -------------------------------------------------------------------

    def classify_health(self, status: int | None, headers: Mapping[str, str]) -> Probe:
        # Connection refused while the engine loads: the socket only listens once it is built
        # (vllm/entrypoints/launchers/launcher.py).
        if status is None:
            return Probe.STARTING
        return Probe.READY if status == 200 else Probe.FAILING

    def parse_metrics(self, payload: Any, previous: EndpointStats | None = None) -> EndpointStats:
        text = payload.decode() if isinstance(payload, bytes) else payload
        if not isinstance(text, str):
            raise MetricsFormatError(f"{self.kind}: expected Prometheus text, got {type(payload).__name__}")
        samples = parse_samples(text, WANTED)
        running = total(first_present(samples, RUNNING))
        waiting = total(first_present(samples, WAITING))
        kv_usage = mean(first_present(samples, KV_USAGE))
        if running is None and waiting is None and kv_usage is None:
            raise MetricsFormatError(
                f"{self.kind}: no vllm:num_requests_running/waiting or KV usage in the metrics "
                "(was the engine started with --disable-log-stats?)"
            )
        prev = previous or EndpointStats()
        block_size, num_blocks = _cache_config(samples.get(CACHE_CONFIG[0]))
        by_reason = _by_label(first_present(samples, WAITING_BY_REASON), "reason")
        return EndpointStats(
            running=int(running if running is not None else prev.running),
            waiting=int(waiting if waiting is not None else prev.waiting),
            kv_usage_ratio=_ratio(kv_usage, prev.kv_usage_ratio),
            prefix_cache_hits_tokens=_or(total(first_present(samples, PREFIX_HITS)), prev.prefix_cache_hits_tokens),
            prefix_cache_queries_tokens=_or(
                total(first_present(samples, PREFIX_QUERIES)), prev.prefix_cache_queries_tokens
            ),
            preemptions=_or(total(first_present(samples, PREEMPTIONS)), prev.preemptions),
            block_size=block_size or prev.block_size,
            num_gpu_blocks=num_blocks or prev.num_gpu_blocks,
            waiting_by_reason={k: int(v) for k, v in by_reason.items()} if by_reason else prev.waiting_by_reason,
            prompt_tokens=_or(total(first_present(samples, PROMPT_TOKENS)), prev.prompt_tokens),
            prompt_tokens_cached=_or(total(first_present(samples, PROMPT_TOKENS_CACHED)), prev.prompt_tokens_cached),
            sleep_state=_sleep_state(first_present(samples, SLEEP_STATE)) or prev.sleep_state,
            kv_offload_bytes=_offload_bytes(first_present(samples, KV_OFFLOAD_BYTES)) or prev.kv_offload_bytes,
            **_lora_info(samples.get(LORA_INFO[0])),
        )

    # --- requests --------------------------------------------------------------------------------

    def shape_request(self, body: Mapping[str, Any], api: str, pool: PoolConfig | None = None) -> dict[str, Any]:
        shaped = dict(body)  # vLLM accepts and logs unknown fields (OpenAIBaseModel, extra="allow")
        if "priority" in shaped:
            priority = clamp_priority(shaped.pop("priority"))
            if priority is not None and wants_priority(pool):
                shaped["priority"] = -priority  # vLLM: int, lower = earlier (chat_completion/protocol.py)
        return shaped

    def prefill_leg_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        leg = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
        leg["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
        leg["stream"] = False
        leg["max_tokens"] = 1
        if "max_completion_tokens" in body:
            leg["max_completion_tokens"] = 1
        if self.prefill_min_tokens is not None:
            leg["min_tokens"] = self.prefill_min_tokens
        return leg

    def decode_leg_body(self, body: Mapping[str, Any], prefill_response: Mapping[str, Any]) -> dict[str, Any]:
        leg = dict(body)
        params = prefill_response.get("kv_transfer_params")
        if params:
            leg["kv_transfer_params"] = params  # verbatim (toy_proxy_server.py)
        else:
            leg.pop("kv_transfer_params", None)  # no params from P: D prefills itself
        return leg


def _cache_config(samples: list[tuple[dict[str, str], float]] | None) -> tuple[int | None, int | None]:
    """block_size and num_gpu_blocks from `vllm:cache_config_info` labels (vllm/v1/metrics/loggers.py)."""
    if not samples:
        return None, None
    labels = samples[0][0]
    return _int_label(labels.get("block_size")), _int_label(labels.get("num_gpu_blocks"))


def _lora_info(samples: list[tuple[dict[str, str], float]] | None) -> dict[str, Any]:
    """`running_loras`, `waiting_loras` and `max_loras` from the newest `vllm:lora_requests_info` series."""
    if not samples:
        return {}
    labels = max(samples, key=lambda sample: sample[1])[0]

    def names(label: str) -> frozenset[str]:
        return frozenset(n for n in labels.get(label, "").split(",") if n)

    return {
        "running_loras": names("running_lora_adapters"),
        "waiting_loras": names("waiting_lora_adapters"),
        "max_loras": _int_label(labels.get("max_lora")) or 0,
    }


def _offload_bytes(samples: list[tuple[dict[str, str], float]] | None) -> dict[str, float]:
    """Bytes moved per offload direction, `gpu_to_cpu` / `cpu_to_gpu` (lower case: the medium names'
    case is the spec's); other transfer types (a connector's own media) are kept under their own name,
    at most `MAX_OFFLOAD_TRANSFERS` of them."""
    out: dict[str, float] = {}
    for key, value in _by_label(samples, "transfer_type").items():
        name = key.lower()
        if name in out or len(out) < MAX_OFFLOAD_TRANSFERS:
            out[name] = out.get(name, 0.0) + value
    return out


MAX_OFFLOAD_TRANSFERS = 8  # transfer types kept per endpoint (the engine's label values, not a client's)


def _by_label(samples: list[tuple[dict[str, str], float]] | None, label: str) -> dict[str, float]:
    """Sum of the samples per value of `label` (over data-parallel ranks)."""
    out: dict[str, float] = {}
    for labels, value in samples or ():
        key = labels.get(label)
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out


def _sleep_state(samples: list[tuple[dict[str, str], float]] | None) -> str | None:
    """`awake`, `weights_offloaded` (sleep level 1), `discard_all` (level 2), from the series at 1;
    `asleep` when `awake` is 0 and no level is marked; None without the metric."""
    states = _by_label(samples, "sleep_state")
    if not states:
        return None
    if states.get("awake", 0.0) >= 1.0:
        return "awake"
    for state in ("weights_offloaded", "discard_all"):
        if states.get(state, 0.0) >= 1.0:
            return state
    return "asleep"


def zmq_bind_host(host: str) -> str | None:
    """The host part of a ZMQ endpoint that vLLM binds (it binds only endpoints containing `*` or
    `::`): `*` for a wildcard host, `[::ffff:a.b.c.d]` for an IPv4 address (ZMQ binds it as that
    IPv4 address), `[v6]` for an IPv6 address written with `::`. None when it cannot be expressed
    (a host name, or an IPv6 address without `::`)."""
    bare = host.strip("[]")
    if bare in ("", "*", "0.0.0.0", "::"):
        return "*"
    if bare == "localhost":
        bare = "127.0.0.1"
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv4Address):
        return f"[::ffff:{address}]"
    return f"[{bare}]" if "::" in bare else None


def _int_label(value: str | None) -> int | None:
    try:
        number = int(float(value)) if value not in (None, "", "None") else None
    except (ValueError, OverflowError):  # "1e999" is a float, an infinite one: no int
        return None
    return number if number and number > 0 else None


def _or(value: float | None, fallback: float) -> float:
    return fallback if value is None else value


def _ratio(value: float | None, fallback: float) -> float:
    return fallback if value is None else min(1.0, max(0.0, value))


def _num(value: float) -> str:
    return f"{value:g}"


def _json(value: Mapping[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


VLLM = VllmAdapter()


@dataclass(frozen=True, slots=True)
class SimAdapter(VllmAdapter):
    """The simulated engine (`sim`): this adapter pointed at `python -m sim`. It speaks vLLM's HTTP API
    and metrics and takes the `vllm serve` flags, plus `--preset MODEL@HW` choosing the performance
    model. It needs no accelerator, so its replicas get no devices unless the pool lists them."""

    kind: str = "sim"
    executable: tuple[str, ...] = (sys.executable, "-m", "sim")
    uses_devices: bool = False
    device_tool: str | None = None

    def platform_args(self, pool: PoolConfig, replica: ReplicaPlan) -> list[str]:
        argv = ["--preset", pool.preset] if pool.preset else []
        if pool.lora_memory_budget_mb is not None:  # the simulated GPU holds what the gateway budgets
            argv += ["--lora-memory-budget-mb", _num(pool.lora_memory_budget_mb)]
        if replica.kv_store_url is not None:  # the pool's store, run by the supervisor (backends/plan.py)
            argv += ["--kv-store-url", replica.kv_store_url]
        return argv


SIM = SimAdapter()


@dataclass(frozen=True, slots=True)
class VllmAscendAdapter(VllmAdapter):
    kind: str = "vllm-ascend"
    device_env: str | None = "ASCEND_RT_VISIBLE_DEVICES"  # vllm_ascend/platform.py
    device_tool: str | None = "npu-smi"
    default_kv_connector: str = "MooncakeConnectorV1"  # vllm_ascend/distributed/kv_transfer/__init__.py
    prefill_min_tokens: int | None = 1  # kv_p2p/mooncake_connector.py handshake

    def validate(self, pool: PoolConfig) -> list[str]:
        return []  # engine_config is Ascend's --additional-config

    def platform_args(self, pool: PoolConfig, replica: ReplicaPlan) -> list[str]:
        if not pool.engine_config:
            return []
        return ["--additional-config", _json(pool.engine_config)]

    def kv_transfer_config(self, pool: PoolConfig, replica: ReplicaPlan) -> dict[str, Any] | None:
        config = VllmAdapter.kv_transfer_config(self, pool, replica)
        if config is not None and str(config.get("kv_connector", "")).startswith("Mooncake"):
            # Mooncake wants both sides' parallel layout (the producer example of vllm-ascend's Mooncake PD tutorial).
            layout = {"dp_size": 1, "tp_size": pool.tensor_parallel}
            extra = dict(config.get("kv_connector_extra_config") or {})
            extra.setdefault("prefill", layout)
            extra.setdefault("decode", layout)
            config["kv_connector_extra_config"] = extra
        return config


VLLM_ASCEND = VllmAscendAdapter()

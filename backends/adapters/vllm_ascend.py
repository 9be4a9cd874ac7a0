"""vllm-ascend: `vllm serve` on Ascend NPUs. Same HTTP API, `/health` and `vllm:*` metrics as vLLM
(it is a platform plugin, pinned to vLLM v0.27.1); facts from vllm-ascend's source (`vllm-project/vllm-ascend`).

Differences from vLLM: devices through `ASCEND_RT_VISIBLE_DEVICES`, block size 128 by default,
Ascend options through `--additional-config` (the pool's `engine_config`), PD through Mooncake
connectors, and a prefill leg that also sets `min_tokens=1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.adapters.base import ReplicaPlan
from backends.adapters.vllm import VllmAdapter, _json
from backends.config import PoolConfig


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

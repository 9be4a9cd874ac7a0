"""The simulated engine (`sim`): the vLLM adapter pointed at `python -m sim`.

It speaks vLLM's HTTP API and metrics (see the vLLM adapter) and takes the `vllm serve` flags, plus `--preset
MODEL@HW` choosing the performance model. It needs no accelerator, so its replicas get no devices
unless the pool lists them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from backends.adapters.base import ReplicaPlan
from backends.adapters.vllm import VllmAdapter
from backends.config import PoolConfig


@dataclass(frozen=True, slots=True)
class SimAdapter(VllmAdapter):
    kind: str = "sim"
    executable: tuple[str, ...] = (sys.executable, "-m", "sim")
    uses_devices: bool = False
    device_tool: str | None = None

    def platform_args(self, pool: PoolConfig, replica: ReplicaPlan) -> list[str]:
        return ["--preset", pool.preset] if pool.preset else []


SIM = SimAdapter()

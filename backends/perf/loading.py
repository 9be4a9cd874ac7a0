"""How long an engine takes to come up, to go to sleep and to wake: weights moved over a link.

- Start-up: the weights read from storage at the load bandwidth, plus a fixed initialisation
  (CUDA context, memory profiling, CUDA-graph capture, compilation). `--load-format dummy` reads no
  weights (random ones are generated on the device), so only the initialisation remains.
- Sleep level 1 (vLLM's sleep mode): each device copies its share of the weights to pinned host
  memory over its own PCIe link and drops the KV cache; waking copies them back the same way.
- Sleep level 2: weights and KV cache are dropped at once; waking reloads the weights from storage at
  the load bandwidth (what an operator does after a level-2 wake). The process, its CUDA graphs and
  its compiled kernels survive both levels, so neither wake pays the initialisation again.

The load bandwidth and the initialisation are properties of the host and of the engine build more
than of the GPU, hence one default for every preset, overridable per engine.
"""

from __future__ import annotations

from typing import Final

from backends.perf.capacity import weight_bytes_per_device
from backends.perf.presets import Preset

DEFAULT_LOAD_BANDWIDTH: Final = 2e9  # bytes/s from storage to the devices (safetensors, page cache cold)
DEFAULT_INIT_S: Final = 5.0  # seconds of engine initialisation beyond reading weights
# Pinned host<->device copies reach about this share of the PCIe link's peak per direction.
PCIE_EFFICIENCY: Final = 0.8
SLEEP_LEVELS: Final = (1, 2)


def weight_load_s(preset: Preset, load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH) -> float:
    """Seconds to read the model's weights from storage (all of them, at `load_bandwidth` bytes/s)."""
    if load_bandwidth <= 0:
        raise ValueError("load bandwidth must be > 0")
    return preset.model.weight_bytes / load_bandwidth


def startup_s(
    preset: Preset,
    load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH,
    init_s: float = DEFAULT_INIT_S,
    load_weights: bool = True,
) -> float:
    """Seconds from launch until the engine serves: weights ÷ load bandwidth + initialisation."""
    if init_s < 0:
        raise ValueError("init_s must be >= 0")
    return (weight_load_s(preset, load_bandwidth) if load_weights else 0.0) + init_s


def host_copy_s(preset: Preset) -> float:
    """Seconds to copy one device's share of the weights between it and pinned host memory (the TP
    ranks copy in parallel, each over its own link)."""
    return weight_bytes_per_device(preset) / (preset.hardware.pcie_bandwidth * PCIE_EFFICIENCY)


def sleep_s(preset: Preset, level: int) -> float:
    """Seconds `POST /sleep?level=N` takes: level 1 offloads the weights, level 2 only frees memory."""
    _check_level(level)
    return host_copy_s(preset) if level == 1 else 0.0


def wake_s(preset: Preset, level: int, load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH) -> float:
    """Seconds to bring the weights back after sleeping at `level` (the KV cache is only reallocated)."""
    _check_level(level)
    return host_copy_s(preset) if level == 1 else weight_load_s(preset, load_bandwidth)


def _check_level(level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, not {level}")

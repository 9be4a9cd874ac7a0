"""Accelerators of this host and their allocation to launched replicas.

Each replica of a pool needs `tensor_parallel x pipeline_parallel` devices. A pool either lists its
devices (`devices: [0, 1, 2, 3]`), takes free ones from the host's inventory (`devices: auto`), or
leaves them unmanaged (`devices: null`: the engine sees whatever the gateway sees, as the simulated
engine needs). The inventory is `backends.devices` when listed, else what `nvidia-smi` / `npu-smi`
report. No device is ever given to two replicas; every impossible request is a `PlanError` naming
the pool.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backends.types import PlanError

# Commands that list device indices, one per line / block.
_LIST_COMMANDS: dict[str, list[str]] = {
    "nvidia-smi": ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
    "npu-smi": ["npu-smi", "info", "-l"],
}
_NPU_ID = re.compile(r"NPU ID\s*:\s*(\d+)")

Runner = Callable[[list[str]], str | None]


def parse_nvidia_smi(text: str) -> tuple[int, ...]:
    """`nvidia-smi --query-gpu=index --format=csv,noheader`: one index per line."""
    return tuple(int(line.strip()) for line in text.splitlines() if line.strip().isdigit())


def parse_npu_smi(text: str) -> tuple[int, ...]:
    """`npu-smi info -l`: blocks with `NPU ID : N` lines."""
    return tuple(int(m) for m in _NPU_ID.findall(text))


_PARSERS: dict[str, Callable[[str], tuple[int, ...]]] = {
    "nvidia-smi": parse_nvidia_smi,
    "npu-smi": parse_npu_smi,
}


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def detect_devices(tool: str, run: Runner = _run) -> tuple[int, ...] | None:
    """This host's device indices according to `tool`; None when the tool is missing or fails."""
    argv = _LIST_COMMANDS.get(tool)
    if argv is None:
        return None
    out = run(argv)
    return None if out is None else _PARSERS[tool](out)


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """One pool's need: `replicas` x `per_replica` devices, listed explicitly or "auto"."""

    pool: str
    replicas: int
    per_replica: int
    devices: tuple[int, ...] | None  # None = auto (take free ones from the inventory)
    parallel_desc: str = ""  # "TP 4 x PP 1" for messages


def allocate_devices(
    requests: Sequence[DeviceRequest], inventory: tuple[int, ...] | None, inventory_source: str = "the host"
) -> dict[str, list[tuple[int, ...]]]:
    """Devices per replica for each pool (replica order), explicit pools first, then auto ones in
    configuration order from what is left. Raises PlanError naming the pool on any conflict."""
    owner: dict[int, str] = {}
    result: dict[str, list[tuple[int, ...]]] = {}
    known = set(inventory) if inventory is not None else None
    for req in requests:
        if req.devices is None:
            continue
        needed = req.replicas * req.per_replica
        listed = req.devices
        if len(set(listed)) != len(listed):
            raise PlanError(f"pool {req.pool!r}: `devices` lists a device twice: {list(listed)}")
        if len(listed) != needed:
            raise PlanError(
                f"pool {req.pool!r}: lists {len(listed)} devices {list(listed)} but needs {needed} "
                f"({req.replicas} replicas x {req.per_replica} per replica{_paren(req.parallel_desc)})"
            )
        if known is not None:
            missing = [d for d in listed if d not in known]
            if missing:
                raise PlanError(
                    f"pool {req.pool!r}: devices {missing} do not exist on {inventory_source} (it has {sorted(known)})"
                )
        for device in listed:
            if device in owner:
                raise PlanError(f"pool {req.pool!r}: device {device} is already given to pool {owner[device]!r}")
            owner[device] = req.pool
        result[req.pool] = _chunks(listed, req.per_replica)
    for req in requests:
        if req.devices is not None:
            continue
        needed = req.replicas * req.per_replica
        if inventory is None:
            raise PlanError(
                f"pool {req.pool!r}: `devices: auto` but this host's devices are unknown "
                "(list them under `backends.devices`, or install nvidia-smi / npu-smi)"
            )
        free = [d for d in inventory if d not in owner]
        if needed > len(free):
            raise PlanError(
                f"pool {req.pool!r}: needs {needed} devices ({req.replicas} replicas x "
                f"{req.per_replica} per replica{_paren(req.parallel_desc)}) but only {len(free)} of "
                f"{inventory_source}'s {len(inventory)} are free ({free})"
            )
        taken = tuple(free[:needed])
        for device in taken:
            owner[device] = req.pool
        result[req.pool] = _chunks(taken, req.per_replica)
    return result


def _chunks(devices: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [tuple(devices[i : i + size]) for i in range(0, len(devices), size)]


def _paren(text: str) -> str:
    return f", {text}" if text else ""

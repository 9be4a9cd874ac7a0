"""LoRA adapters as the fleet knows them: a name clients ask for, served by the pools of its base model.

The policy declares them (`models:` entries of `kind: adapter`, policies/schema.py); the gateway
hands the fleet this view on every policy (re)load, so the fleet answers "which pools serve it" and
the transport knows what to load (docs/adapters.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

MB = 1024 * 1024
DEFAULT_ADAPTER_BYTES = 64 * MB  # an adapter whose size is unknown (a rank-16 adapter of an 8B model is tens of MB)
MAX_SIZED_FILES = 10_000  # files summed for a local adapter's size: a directory is not trusted to be small


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str  # the public name, and the name the engines serve it under (vLLM's lora_name)
    base_model: str  # the public model whose pools serve it
    source: str  # what the engine loads: a local path, or a URI its resolvers understand
    size_bytes: int | None = None  # the predicted load time and a pool's memory budget; None: unknown
    preload: bool = False  # loaded on every ready replica of its base's pools, never unloaded for idleness
    idle_unload_s: float | None = None  # unloaded from a replica where it went unused this long; None: the pool's

    def load_s(self, bandwidth_bytes_s: float, default_bytes: int) -> float:
        """Seconds to bring it onto a GPU at `bandwidth_bytes_s` (`default_bytes` when its size is unknown)."""
        return (self.size_bytes or default_bytes) / bandwidth_bytes_s


def local_size_bytes(source: str) -> int | None:
    """Bytes of a local adapter (a file, or a directory's files) when it is readable here, else None (a
    URI the engine resolves, or a path only the engine's host has). Read when the policy loads, so a
    pool's memory budget counts the adapter as the engine will hold it without a `size_mb` to keep true."""
    if "://" in source or not os.path.isabs(source):
        return None
    try:
        if os.path.isfile(source):
            return os.path.getsize(source)
        if not os.path.isdir(source):
            return None
        total = files = 0
        for root, _dirs, names in os.walk(source):
            for name in names:
                total += os.path.getsize(os.path.join(root, name))
                files += 1
                if files >= MAX_SIZED_FILES:
                    return total
        return total or None
    except OSError:
        return None


def budget_bytes(budget_mb: float | None) -> int | None:
    """A pool's `lora_memory_budget_mb` in bytes (None: no budget, `max_loras` alone bounds a replica)."""
    return int(budget_mb * MB) if budget_mb is not None else None


def too_large(adapter: LoraAdapter, budgets: Iterable[tuple[str, int | None]]) -> str | None:
    """Why `adapter` fits none of the pools (`(pool, budget bytes)`) that would serve it, else None: an
    adapter larger than a replica's whole budget can never be loaded there, whatever is evicted."""
    size = adapter.size_bytes
    listed = list(budgets)
    if size is None or not listed or any(budget is None or size <= budget for _pool, budget in listed):
        return None
    pools = ", ".join(f"{pool} ({budget / MB:g} MB)" for pool, budget in listed if budget is not None)
    return (
        f"The adapter '{adapter.name}' ({size / MB:g} MB) is larger than the LoRA memory budget of every pool "
        f"serving its base model '{adapter.base_model}': {pools} (lora_memory_budget_mb)"
    )

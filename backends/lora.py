"""LoRA adapters as the fleet knows them: a name clients ask for, served by the pools of its base model.

The policy declares them (`models:` entries of `kind: adapter`, policies/schema.py); the gateway
hands the fleet this view on every policy (re)load, so the fleet answers "which pools serve it" and
the transport knows what to load (docs/adapters.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str  # the public name, and the name the engines serve it under (vLLM's lora_name)
    base_model: str  # the public model whose pools serve it
    source: str  # what the engine loads: a local path, or a URI its resolvers understand
    size_bytes: int | None = None  # for the predicted load time; None: unknown
    preload: bool = False  # loaded on every ready replica of its base's pools, never unloaded for idleness
    idle_unload_s: float | None = None  # unloaded from a replica where it went unused this long; None: the pool's

    def load_s(self, bandwidth_bytes_s: float, default_bytes: int) -> float:
        """Seconds to bring it onto a GPU at `bandwidth_bytes_s` (`default_bytes` when its size is unknown)."""
        return (self.size_bytes or default_bytes) / bandwidth_bytes_s

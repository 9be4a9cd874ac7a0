"""LoRA adapters in the simulated engine: registration, GPU slots, load time and the per-step cost.

What it models, after vLLM's multi-LoRA serving (docs.vllm.ai, "LoRA Adapters"; S-LoRA and Punica for
the batched kernels):

- **Registration** (`--lora-modules name=path` at start, `POST /v1/load_lora_adapter` and
  `/v1/unload_lora_adapter` at run time, bodies `{"lora_name", "lora_path"}` and `{"lora_name"}`): a
  registered adapter is a model name requests may ask for, listed by `/v1/models` with its base as
  `parent`. A local path that does not exist is refused (404) as vLLM refuses it; other sources
  (object-store URIs, hub ids) are accepted, the engine resolving them.
- **GPU slots.** At most `max_loras` distinct adapters run in one batch (the scheduler skips a waiting
  request whose adapter would be one too many, as vLLM V1's does) and `max_loras` adapters are
  resident on the GPU, least recently used first out; with a memory budget (`--lora-memory-budget-mb`,
  the gateway's `lora_memory_budget_mb`) the resident adapters' sizes stay within it too (a batch's
  adapters must fit it together, and one larger than the whole budget is refused at registration, 400).
  A step whose batch holds an adapter that is not
  resident loads it first: the step takes `size / bandwidth + fixed` longer (the load is synchronous
  in vLLM's model runner, so every request of the batch waits for it).
- **Per-step cost**: each distinct adapter in the batch adds `per_adapter_step_s` (the batched LoRA
  kernels' extra work; small beside the base model's).
- **Blocks**: a request's KV block hashes are salted by its adapter (`backends.block_hash.lora_salt`),
  so two adapters never share cached blocks, and its KV events carry `lora_name`.
- **Metrics**: `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`,
  vLLM's gauge (the adapters of running and waiting requests, comma-separated; value = the time of
  the scrape).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.scheduler import Request

DEFAULT_MAX_LORAS = 1  # vLLM's default --max-loras
DEFAULT_SIZE_BYTES = 64 * 1024 * 1024  # a rank-16 adapter of an 8B model is tens of MB
DEFAULT_LOAD_BANDWIDTH = 1e9  # bytes/s: disk or host memory to the GPU, with the tensors' set-up
DEFAULT_LOAD_FIXED_S = 0.02  # per load, whatever the size (allocation, kernel metadata)
DEFAULT_PER_ADAPTER_STEP_S = 0.0003  # per distinct adapter in a batch


class LoraError(Exception):
    """A load or unload the engine refuses: `status` and vLLM's error message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    size_bytes: int
    int_id: int


def adapter_size(path: str, default: int = DEFAULT_SIZE_BYTES) -> int:
    """Bytes of a local adapter directory (or file); `default` for a source the engine resolves."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    if os.path.isdir(path):
        total = 0
        for root, _dirs, files in os.walk(path):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total or default
    return default


def adapter_of(lora: LoraSlots | None, body: Mapping[str, object]) -> str | None:
    """The registered adapter a request body names as its `model`, else None (the base model)."""
    model = body.get("model")
    if lora is None or not isinstance(model, str) or model not in lora.registered:
        return None
    return model


def adapter_names(lora: LoraSlots | None) -> Collection[str]:
    return lora.registered.keys() if lora is not None else ()


def batch_adapters(prefills: Iterable[tuple[Request, int, int]], decodes: Iterable[tuple[Request, int]]) -> set[str]:
    """The adapters of one step's batch."""
    names = {req.lora_name for req, _n, _ctx in prefills if req.lora_name}
    names.update(req.lora_name for req, _ctx in decodes if req.lora_name)
    return names


class LoraSlots:
    """One engine's adapters: those registered, those resident on the GPU (LRU), and what loading costs."""

    def __init__(
        self,
        max_loras: int = DEFAULT_MAX_LORAS,
        *,
        load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH,
        load_fixed_s: float = DEFAULT_LOAD_FIXED_S,
        per_adapter_step_s: float = DEFAULT_PER_ADAPTER_STEP_S,
        default_size_bytes: int = DEFAULT_SIZE_BYTES,
        base_model: str = "",
        memory_budget: int | None = None,
    ) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if load_bandwidth <= 0:
            raise ValueError("the LoRA load bandwidth must be > 0")
        self.max_loras = max_loras
        self.load_bandwidth = load_bandwidth
        self.load_fixed_s = load_fixed_s
        self.per_adapter_step_s = per_adapter_step_s
        self.default_size_bytes = default_size_bytes
        self.base_model = base_model
        self.memory_budget = memory_budget
        self.registered: dict[str, Adapter] = {}
        self.resident: OrderedDict[str, None] = OrderedDict()  # GPU slots, least recently used first
        self.loads = 0
        self.evictions = 0
        self.load_s_total = 0.0
        self._next_id = 1

    # --- registration ------------------------------------------------------------------------------

    def register(self, name: str, path: str, size_bytes: int | None = None) -> Adapter:
        """Make `name` servable (vLLM's load_lora_adapter); LoraError as vLLM refuses it."""
        if not name or not path:
            raise LoraError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.registered:
            raise LoraError(400, f"The lora adapter '{name}' has already been loaded.")
        if os.path.isabs(path) and not os.path.exists(path):
            raise LoraError(404, f"Loading lora {name} failed: No adapter found for {path}")
        size = size_bytes if size_bytes is not None else adapter_size(path, self.default_size_bytes)
        if self.memory_budget is not None and size > self.memory_budget:
            raise LoraError(
                400,
                f"Loading lora {name} failed: its {size} bytes exceed the LoRA memory budget of {self.memory_budget}",
            )
        adapter = Adapter(name, path, size, self._next_id)
        self._next_id += 1
        self.registered[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        """Forget `name` (vLLM's unload_lora_adapter); its GPU slot frees."""
        if name not in self.registered:
            raise LoraError(404, f"The lora adapter '{name}' cannot be found.")
        del self.registered[name]
        self.resident.pop(name, None)

    def knows(self, name: str) -> bool:
        return name in self.registered

    def load_s(self, name: str) -> float:
        """Simulated seconds to bring `name` onto the GPU."""
        adapter = self.registered.get(name)
        size = adapter.size_bytes if adapter is not None else self.default_size_bytes
        return self.load_fixed_s + size / self.load_bandwidth

    # --- scheduling --------------------------------------------------------------------------------

    def size_of(self, name: str) -> int:
        adapter = self.registered.get(name)
        return adapter.size_bytes if adapter is not None else self.default_size_bytes

    def admissible(self, name: str, batch: set[str]) -> bool:
        """Whether a request of adapter `name` may join a batch already running `batch`'s adapters (at
        most `max_loras` of them, their sizes within the memory budget together)."""
        if name in batch:
            return True
        if len(batch) >= self.max_loras:
            return False
        budget = self.memory_budget
        return budget is None or sum(map(self.size_of, batch)) + self.size_of(name) <= budget

    def step_cost_s(self, active: Iterable[str]) -> float:
        """Extra simulated seconds of a step whose batch runs `active` adapters: loads of those not
        resident (evicting the least recently used idle ones), plus the per-adapter kernel cost."""
        names = set(active)
        if not names:
            return 0.0
        extra = self.per_adapter_step_s * len(names)
        resident = self.resident
        for name in names:
            if name in resident:
                resident.move_to_end(name)
                continue
            while len(resident) >= self.max_loras or self._over_budget(name):
                victim = next((n for n in resident if n not in names), None)
                if victim is None:  # cannot happen while the scheduler caps the batch at max_loras
                    break
                del resident[victim]
                self.evictions += 1
            resident[name] = None
            cost = self.load_s(name)
            extra += cost
            self.loads += 1
            self.load_s_total += cost
        return extra

    def _over_budget(self, name: str) -> bool:
        """Whether bringing `name` onto the GPU would take the resident adapters over the memory budget."""
        budget = self.memory_budget
        return budget is not None and sum(map(self.size_of, self.resident)) + self.size_of(name) > budget

    # --- reporting ---------------------------------------------------------------------------------

    def models(self, created: int) -> list[dict[str, object]]:
        """`/v1/models` entries of the registered adapters (vLLM lists them with their base as parent)."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": a.path,
                "parent": self.base_model,
                "permission": [],
            }
            for a in self.registered.values()
        ]

    def prometheus(self, running: Iterable[str], waiting: Iterable[str]) -> bytes:
        """vLLM's `vllm:lora_requests_info` gauge (running and waiting requests' adapters)."""
        run = ",".join(sorted(set(running)))
        wait = ",".join(sorted(set(waiting)))
        return (
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            "# TYPE vllm:lora_requests_info gauge\n"
            f'vllm:lora_requests_info{{max_lora="{self.max_loras}",'
            f'running_lora_adapters="{run}",waiting_lora_adapters="{wait}"}} {time.time():.3f}\n'
        ).encode()

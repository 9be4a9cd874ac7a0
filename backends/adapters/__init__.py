"""Engine adapters: one module per engine kind (`vllm.py` also holds the simulated engine's), and
`ADAPTERS`, the one place that lists them by kind (a new engine is one module plus one line here).

The keys are the `engine:` values of gateway.yaml (`backends.config.EngineKind`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from backends.adapters.base import EngineAdapter, LaunchSpec, Probe, ReplicaPlan
from backends.adapters.hosted import ANTHROPIC, AZURE_OPENAI, BEDROCK, GEMINI
from backends.adapters.openai_remote import OPENAI_REMOTE
from backends.adapters.trtllm import TRTLLM
from backends.adapters.vllm import SIM, VLLM
from backends.adapters.vllm_ascend import VLLM_ASCEND

__all__ = ["ADAPTERS", "EngineAdapter", "LaunchSpec", "Probe", "ReplicaPlan", "get_adapter"]

ADAPTERS: Mapping[str, EngineAdapter] = MappingProxyType({
    "vllm": VLLM,
    "trtllm": TRTLLM,
    "vllm-ascend": VLLM_ASCEND,
    "openai": OPENAI_REMOTE,
    "anthropic": ANTHROPIC,
    "bedrock": BEDROCK,
    "gemini": GEMINI,
    "azure-openai": AZURE_OPENAI,
    "sim": SIM,
})  # fmt: skip


def get_adapter(kind: str) -> EngineAdapter:
    """The adapter of an engine kind; KeyError names the known kinds."""
    try:
        return ADAPTERS[kind]
    except KeyError:
        raise KeyError(f"unknown engine kind {kind!r}; known: {', '.join(sorted(ADAPTERS))}") from None

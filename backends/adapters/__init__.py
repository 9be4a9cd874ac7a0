"""Engine adapters: one module per engine kind, looked up by kind in `registry`."""

from backends.adapters.base import EngineAdapter, LaunchSpec, Probe, ReplicaPlan
from backends.adapters.registry import ADAPTERS, get_adapter

__all__ = ["ADAPTERS", "EngineAdapter", "LaunchSpec", "Probe", "ReplicaPlan", "get_adapter"]

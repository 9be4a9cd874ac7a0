"""Every filter, scorer, picker and baseline router by the kebab-case name gateway.yaml uses.

One read-only mapping per kind, built once; adding a component is one class (in `filters.py`,
`scorers.py`, `pickers.py` or `baselines.py`) plus one line here.
Factories take the component's `params` as keyword arguments and raise on unknown or invalid ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from policies.routing.baselines import LeastInflightRouter, RoundRobinRouter
from policies.routing.filters import ContextLengthFilter, LoadGateFilter, PrefixAffinityFilter
from policies.routing.lora import LoraAffinityScorer, LoraSlotsFilter
from policies.routing.pickers import MaxScorePicker, NearBestRandomPicker, RandomPicker, WeightedRandomPicker
from policies.routing.scorers import (
    InflightTokensScorer,
    KvUsageScorer,
    LatencyScorer,
    PrefixCacheScorer,
    QueueDepthScorer,
    SessionAffinityScorer,
    WorkCostScorer,
)
from policies.routing.tool_affinity import ToolAffinityScorer
from policies.routing.types import Filter, Picker, Router, Scorer

FILTERS: Mapping[str, Callable[..., Filter]] = MappingProxyType(
    {
        "load-gate": LoadGateFilter,
        "context-length": ContextLengthFilter,
        "lora-slots": LoraSlotsFilter,
        "prefix-affinity": PrefixAffinityFilter,
    }
)

SCORERS: Mapping[str, Callable[..., Scorer]] = MappingProxyType(
    {
        "prefix-cache": PrefixCacheScorer,
        "queue-depth": QueueDepthScorer,
        "kv-usage": KvUsageScorer,
        "inflight-tokens": InflightTokensScorer,
        "session-affinity": SessionAffinityScorer,
        "work-cost": WorkCostScorer,
        "latency": LatencyScorer,
        "lora-affinity": LoraAffinityScorer,
        "tool-affinity": ToolAffinityScorer,
    }
)

PICKERS: Mapping[str, Callable[..., Picker]] = MappingProxyType(
    {
        "max-score": MaxScorePicker,
        "near-best-random": NearBestRandomPicker,
        "weighted-random": WeightedRandomPicker,
        "random": RandomPicker,
    }
)

# Routers that replace the whole pipeline for a pool (`router:` in a pipeline config); "scoring" is
# the pipeline itself and is built by `policies.routing.pipeline`.
BASELINE_ROUTERS: Mapping[str, Callable[[], Router]] = MappingProxyType(
    {
        "least-inflight": LeastInflightRouter,
        "round-robin": RoundRobinRouter,
    }
)

REGISTRIES: Mapping[str, Mapping[str, Callable[..., Any]]] = MappingProxyType(
    {"filter": FILTERS, "scorer": SCORERS, "picker": PICKERS}
)


def build(kind: str, name: str, params: Mapping[str, Any]) -> Any:
    """Instantiate a registered component; ValueError names the kind, the name and what is wrong."""
    registry = REGISTRIES[kind]
    factory = registry.get(name)
    if factory is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")
    try:
        return factory(**params)
    except TypeError as exc:
        raise ValueError(f"{kind} {name!r}: bad params {dict(params)!r}: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{kind} {name!r}: {exc}") from exc

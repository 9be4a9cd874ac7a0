"""The planners by the name `autoscale.planner` gives: token velocity, or the HPA-shaped baseline."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from backends.autoscale.config import AutoscaleConfig
from backends.autoscale.hpa import plan_hpa
from backends.autoscale.planner import plan_pool
from backends.autoscale.types import PlannerMemory, PoolPlan, PoolSignals

Planner = Callable[[PoolSignals, AutoscaleConfig, PlannerMemory], PoolPlan]

PLANNERS: Final[Mapping[str, Planner]] = MappingProxyType({"tokens": plan_pool, "hpa": plan_hpa})

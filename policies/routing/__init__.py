"""Routing: which endpoint of a pool serves a request (filters -> weighted scorers -> picker, a prefix
index, session pins and PD placement). Decisions are synchronous; see `pipeline.py`."""

from policies.routing.config import RoutingConfig
from policies.routing.pipeline import ScoringRouter, build_router
from policies.routing.types import RouteDecision, Router

__all__ = ["RouteDecision", "Router", "RoutingConfig", "ScoringRouter", "build_router"]

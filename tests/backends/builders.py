"""Helpers shared by the backends tests: pool/replica builders and the metrics fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.adapters.base import ReplicaPlan
from backends.config import PoolConfig
from backends.types import Role

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def pool(**fields: Any) -> PoolConfig:
    """A PoolConfig with test defaults (one launched replica of `m`)."""
    fields.setdefault("name", "p")
    fields.setdefault("model", "m")
    if "roles" not in fields and "endpoints" not in fields:
        fields.setdefault("replicas", 1)
    return PoolConfig.model_validate(fields)


def replica(**fields: Any) -> ReplicaPlan:
    fields.setdefault("pool", "p")
    fields.setdefault("role", Role.BOTH)
    fields.setdefault("index", 0)
    fields.setdefault("host", "127.0.0.1")
    fields.setdefault("port", 8100)
    fields.setdefault("log_path", "var/log/engines/p.both-0.log")
    return ReplicaPlan(**fields)

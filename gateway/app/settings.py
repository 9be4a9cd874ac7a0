"""gateway.yaml: the schema of the gateway process and how it is loaded.

Sections owned by other rooms (pools, backends, routing, flow_control, predictor, telemetry, ledger) are validated
by those rooms' own pydantic models; this module composes them. Loading resolves `${ENV}` references
(secrets never live in YAML) and relative paths (against the config file's folder), and turns
validation failures into one message naming the file, the key path and what was expected.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from backends.config import PoolConfig
from gateway.replicas.config import ReplicasSettings

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names file, key path and expectation."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FirstTokenDeadline(_Strict):
    """`server.first_token_deadline`: a stream that has shown its client nothing by then moves to another
    replica (gateway/upstream/stalls.py). The deadline is `factor` x the predictor's TTFT p90 for the chosen
    replica (`default_s` without a prediction), clamped to [`min_s`, `max_s`]; it is armed only while
    another replica may still take the request (never on its last try)."""

    enabled: bool = True
    factor: float = Field(default=3.0, gt=0, description="x the predicted TTFT p90")
    default_s: float = Field(default=10.0, gt=0, description="without a prediction")
    min_s: float = Field(default=2.0, gt=0)
    max_s: float = Field(default=30.0, gt=0)
    misses_to_stall: int = Field(
        default=2, ge=1, description="deadlines a replica misses with no sign of life between them: stalled"
    )


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_inflight_body_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="request bodies being read and counted, all at once"
    )
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, description="one header line / field")
    request_read_timeout_s: float = Field(default=30.0, gt=0, description="full request must arrive within")
    drain_timeout_s: float = Field(default=30.0, ge=0, description="SIGTERM: in-flight requests finish within")
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    upstream_read_timeout_s: float = Field(default=600.0, gt=0, description="max silence from the engine")
    upstream_idle_timeout_s: float = Field(
        default=4.0, gt=0, description="idle keep-alive connections to engines are dropped after (uvicorn: 5 s)"
    )
    upstream_retries: int = Field(default=1, ge=0, description="extra endpoints tried before the first byte")
    first_token_deadline: FirstTokenDeadline = Field(default_factory=FirstTokenDeadline)
    stall_after_s: float = Field(
        default=10.0, gt=0, description="a replica whose requests in flight get no byte for this long is stalled"
    )
    admin_token: str | None = Field(default=None, description="bearer token for /admin/*; use ${ENV}")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="extra Host names (name or name:port) /admin/* and /ui/* answer to besides loopback "
        "literals and localhost on the listening port; set, they are checked with an admin token too",
    )
    retry_after_s: int = Field(default=1, ge=0, description="retry-after on 503 no_healthy_backend")
    ready_when: Literal["all_pools", "default_pool", "any_pool"] = Field(
        default="all_pools",
        description="/readyz is 200 when every pool, the default pool, or at least one pool has a ready endpoint",
    )
    default_pool: str | None = Field(default=None, description="the pool `ready_when: default_pool` watches; first")
    gc_young_threshold: int = Field(
        default=20_000, ge=0, description="allocations between young-generation GC passes; 0: Python's default"
    )

    @field_validator("admin_token")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return value or None  # `${TOKENWAY_ADMIN_TOKEN:-}` unset: no token (and no start beyond loopback)

    @field_validator("allowed_hosts")
    @classmethod
    def _bare_host_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name or any(c in name for c in "/@ \t*") or "://" in name:
                raise ValueError(f"{name!r}: a host name or name:port (no scheme, path or wildcard)")
        return [name.strip().lower() for name in value]


class StateSettings(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = None
    key_prefix: str = "tokenway"
    redis_timeout_s: float = Field(
        default=0.1,
        gt=0,
        le=30,
        description="bound on each admission call to Redis (connect and read); a call past it counts "
        "as a store failure for the breaker and `store_failure`",
    )
    replicas: ReplicasSettings = Field(default_factory=ReplicasSettings)
    keys_db: str | None = Field(
        default="var/keys.sqlite3",
        description="the SQLite file of keys and tenants made through the admin API (null: kept in memory "
        "only); with redis they live in Redis and this file is each replica's durable copy, put back into "
        "a Redis that restarted empty (null: Redis only)",
    )

    @property
    def shares_routing(self) -> bool:
        """Whether replicas publish and fold routing state (on by default with Redis)."""
        share = self.replicas.share
        return self.backend == "redis" and self.redis_url is not None and (share is None or share)


class GatewaySettings(_Strict):
    server: ServerSettings = Field(default_factory=ServerSettings)
    state: StateSettings = Field(default_factory=StateSettings)
    policies: str = Field(default="policies.yaml", description="path of policies.yaml (relative to this file)")
    backends: dict[str, Any] = Field(default_factory=dict)
    pools: list[PoolConfig] = Field(default_factory=list)
    routing: dict[str, Any] = Field(default_factory=dict)
    flow_control: dict[str, Any] = Field(default_factory=dict)
    apis: dict[str, Any] = Field(default_factory=dict)  # gateway/apis/config.py
    batch: dict[str, Any] = Field(default_factory=dict)  # gateway/batch/config.py
    predictor: dict[str, Any] = Field(default_factory=dict)
    telemetry: dict[str, Any] = Field(default_factory=dict)
    ledger: dict[str, Any] = Field(default_factory=dict)
    epp: dict[str, Any] = Field(default_factory=dict)  # `tokenway epp` (gateway/epp/config.py)
    source: str = Field(default="<memory>", exclude=True)

    def resolve_path(self, path: str) -> Path:
        """A path from this file, made absolute against the config file's folder."""
        p = Path(path)
        if p.is_absolute() or self.source.startswith("<"):
            return p
        return Path(self.source).parent / p


def resolve_env(value: Any, where: str = "", unset: list[str] | None = None) -> Any:
    """Replace `${NAME}` / `${NAME:-default}` in every string of a parsed YAML tree.

    An unset variable without a default is an error, unless `unset` is given (dry runs such as
    `tokenway pools plan`): then the reference stays as written, a placeholder, and `unset` collects
    `key.path: NAME` for the warning."""
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            found = os.environ.get(name)
            if found is not None:
                return found
            if default is not None:
                return default
            if unset is not None:
                unset.append(f"{where or '<root>'}: {name}")
                return match.group(0)
            raise ConfigError(f"{where or '<root>'}: environment variable {name} is not set")

        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: resolve_env(v, f"{where}.{k}" if where else str(k), unset) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env(v, f"{where}[{i}]", unset) for i, v in enumerate(value)]
    return value


def format_validation_error(path: str, error: ValidationError) -> str:
    lines = [f"{path}: invalid configuration"]
    for item in error.errors():
        loc = ""
        for part in item["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        lines.append(f"  {loc or '<root>'}: {item['msg']} (got {_short(item.get('input'))})")
    return "\n".join(lines)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


M = TypeVar("M", bound=BaseModel)


def load_yaml_model(
    path: str | Path, model: type[M], extra: dict[str, Any] | None = None, unset: list[str] | None = None
) -> M:
    """Read a YAML file into a pydantic model with precise errors (file, key path, expectation).
    `unset`: see `resolve_env` (unset variables kept as placeholders and listed there)."""
    path = str(path)
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: file not found") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    try:
        raw = resolve_env(raw, unset=unset)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    try:
        return model.model_validate({**raw, **(extra or {})})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc)) from exc


def load_settings(path: str | Path, unset: list[str] | None = None) -> GatewaySettings:
    return load_yaml_model(path, GatewaySettings, {"source": str(path)}, unset)


def validate_section(settings: GatewaySettings, section: str, model: type[M]) -> M:
    """Validate one room-owned section (e.g. `routing`) with that room's model, with precise errors."""
    try:
        return model.model_validate(getattr(settings, section) or {})
    except ValidationError as exc:
        message = format_validation_error(settings.source, exc)
        raise ConfigError(message.replace("\n  ", f"\n  {section}.")) from exc

"""gateway.yaml: one typed settings tree, and how it is loaded.

`GatewaySettings` holds every section as the model of the room that owns it (the gateway's own in
`gateway/app/schema.py`, the pools and the supervisor in `backends/config.py`, routing, flow control,
the predictor and batch beside their code), so the whole file is validated once, when it is loaded,
and the code receives typed objects: a mistake anywhere stops start-up (and `tokenway check`) with one
message naming the file, the key path and what was expected, never later on the path that reads it.
Loading resolves `${ENV}` references (secrets never live in YAML) and relative paths (against the
config file's folder). `docs/configuration.md` is generated from this tree (`gateway/app/config_doc.py`).
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from types import UnionType
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backends.config import BackendsSettings, PoolConfig
from gateway.app.schema import ApisSettings, EppSettings, LedgerConfig, ReplicasAdvanced, TelemetryConfig
from gateway.app.schema import FirstTokenDeadline as FirstTokenDeadline
from gateway.app.schema import ServerSettings as ServerSettings
from gateway.app.schema import StateSettings as StateSettings
from gateway.batch.config import BatchSettings
from policies.flow.config import FlowAdvanced, FlowSettings
from policies.routing.config import PrefixIndexAdvanced, RoutingConfig
from predictor.config import PredictorAdvanced, PredictorSettings

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names file, key path and expectation."""


class GatewaySettings(BaseModel):
    """The whole of gateway.yaml; each section is its owner's model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: ServerSettings = Field(default_factory=ServerSettings, description="the listening socket and timeouts")
    state: StateSettings = Field(default_factory=StateSettings, description="where limits and shared state live")
    policies: str = Field(default="policies.yaml", description="path of policies.yaml (relative to this file)")
    backends: BackendsSettings = Field(
        default_factory=BackendsSettings, description="how the supervisor launches and watches engines"
    )
    pools: list[PoolConfig] = Field(default_factory=list, description="the models served and their engines")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="which endpoint serves a request")
    flow_control: FlowSettings = Field(
        default_factory=FlowSettings, description="when a pool is saturated and how much may wait"
    )
    apis: ApisSettings = Field(default_factory=ApisSettings, description="the translated APIs' own state")
    batch: BatchSettings = Field(default_factory=BatchSettings, description="the Batch and Files APIs")
    predictor: PredictorSettings = Field(default_factory=PredictorSettings, description="latency predictions")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="Prometheus and OpenTelemetry")
    ledger: LedgerConfig = Field(default_factory=LedgerConfig, description="one usage record per request")
    epp: EppSettings = Field(default_factory=EppSettings, description="`tokenway epp`, the endpoint picker")
    source: str = Field(default="<memory>", exclude=True)

    def resolve_path(self, path: str) -> Path:
        """A path from this file, made absolute against the config file's folder."""
        p = Path(path)
        if p.is_absolute() or self.source.startswith("<"):
            return p
        return Path(self.source).parent / p


# Expert tunables live in an `advanced:` block of the model they tune (the defaults are measured; a
# change is a benchmark's decision). A key at its old place is refused with an error naming the new
# one rather than accepted with a warning: a warning in a start-up log is read too late.
ADVANCED_BLOCKS: dict[str, type[BaseModel]] = {
    "predictor": PredictorAdvanced,
    "routing.prefix_index": PrefixIndexAdvanced,
    "state.replicas": ReplicasAdvanced,
    "flow_control": FlowAdvanced,
}
MOVED_TO_ADVANCED: dict[str, str] = {
    f"{where}.{key}": f"{where}.advanced.{key}"
    for where, block in ADVANCED_BLOCKS.items()
    for key in block.model_fields
}


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


def format_validation_error(path: str, error: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line per problem: key path, what was expected, what was given. With `model` (the tree
    that was validated), an unknown key names the nearest valid key at its place: a misspelling is
    the commonest mistake, and the list of valid keys is long."""
    lines = [f"{path}: invalid configuration"]
    for item in error.errors():
        loc = ""
        for part in item["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        message = str(item["msg"])
        moved = MOVED_TO_ADVANCED.get(loc) if model is GatewaySettings else None
        if item["type"] == "extra_forbidden" and moved is not None:
            message = f"moved to `{moved}` (expert tunables live under `advanced:`)"
        elif item["type"] == "extra_forbidden" and model is not None and item["loc"]:
            message = "unknown key" + _nearest(str(item["loc"][-1]), keys_at(model, tuple(item["loc"][:-1])))
        elif item["type"] == "literal_error" and isinstance(item.get("input"), str):
            choices = re.findall(r"'([^']*)'", str((item.get("ctx") or {}).get("expected", "")))
            close = difflib.get_close_matches(item["input"], choices, n=1, cutoff=0.6)
            message += f"; did you mean {close[0]!r}?" if close else ""
        lines.append(f"  {loc or '<root>'}: {message} (got {_short(item.get('input'))})")
    return "\n".join(lines)


def _nearest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; valid keys here: {', '.join(known)}" if known else ""


def keys_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """The keys valid at `loc` (a pydantic error location) inside `model`: the fields of the model
    found there, through lists, mappings, optional values and unions of models."""
    types: list[Any] = [model]
    for part in loc:
        types = [found for annotation in types for found in _step(annotation, part)]
    return sorted({name for annotation in types for name in _fields(annotation)})


def _members(annotation: Any) -> list[Any]:
    if get_origin(annotation) in (Union, UnionType):
        return [m for arg in get_args(annotation) for m in _members(arg)]
    return [annotation]


def _fields(annotation: Any) -> list[str]:
    return [
        name
        for member in _members(annotation)
        if isinstance(member, type) and issubclass(member, BaseModel)
        for name in member.model_fields
    ]


def _step(annotation: Any, part: str | int) -> list[Any]:
    """Where one step of an error location leads from `annotation` (a union member's tag stays put)."""
    found: list[Any] = []
    for member in _members(annotation):
        origin, args = get_origin(member), get_args(member)
        if isinstance(member, type) and issubclass(member, BaseModel):
            if member.__name__ == part:
                found.append(member)
            elif isinstance(part, str) and part in member.model_fields:
                found.append(member.model_fields[part].annotation)
        elif origin in (list, tuple) and args and isinstance(part, int):
            found.append(args[0])
        elif origin is dict and len(args) == 2:
            found.append(args[1])
    return found


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
        raise ConfigError(format_validation_error(path, exc, model)) from exc


def load_settings(path: str | Path, unset: list[str] | None = None) -> GatewaySettings:
    return load_yaml_model(path, GatewaySettings, {"source": str(path)}, unset)

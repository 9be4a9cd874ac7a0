"""Loading config/policies.yaml: YAML -> `${ENV}` resolution -> schema validation -> compiled Policy.

Every problem is reported as `FILE:LINE: key.path[2].field: what was expected, got what`, all at
once, so an operator fixes a file in one pass and `tokenway policies check FILE` can gate a deploy.
Secrets never live in the file: `${NAME}` (or `${NAME:-default}`) is replaced by the environment
variable at load; an unset variable without a default is an error naming its key path.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from policies.policy import Policy

if typing.TYPE_CHECKING:
    from policies.keys.directory import KeyDirectory
from policies.schema import PoliciesConfig, ReferenceErrors, format_path

Loc = tuple[str | int, ...]

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class PolicyFileError(Exception):
    """A policies file that cannot be used; `messages` holds one precise line per problem."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("\n".join(messages))
        self.messages = messages


def load_config(path: str | Path, env: Mapping[str, str] | None = None, *, text: str | None = None) -> PoliciesConfig:
    """The file's configuration; `text` is its content when the caller has read it already (a reload
    reads once, so what it checks is what it loads)."""
    path = Path(path)
    if text is None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PolicyFileError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    return parse_config(text, str(path), env)


def load_policy(
    path: str | Path,
    env: Mapping[str, str] | None = None,
    *,
    text: str | None = None,
    directory: KeyDirectory | None = None,
) -> Policy:
    return Policy(load_config(path, env, text=text), source=str(path), directory=directory)


def check_file(path: str | Path, env: Mapping[str, str] | None = None) -> list[str]:
    """Every problem of a policies file, one message each; empty when the file is valid."""
    try:
        load_policy(path, env)
    except PolicyFileError as exc:
        return exc.messages
    return []


def parse_config(text: str, source: str = "<policies>", env: Mapping[str, str] | None = None) -> PoliciesConfig:
    lines: dict[Loc, int] = {}
    problems: list[tuple[Loc, str]] = []
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyFileError([f"{where}: invalid YAML: {problem}"]) from None
    if root is not None:
        _index_lines(root, (), lines, problems)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyFileError([f"{source}:1: expected a mapping at the top level, got {type(data).__name__}"])
    data = _resolve_env(data, (), os.environ if env is None else env, problems)
    config: PoliciesConfig | None = None
    env_locs = {loc for loc, _ in problems}
    try:
        config = PoliciesConfig.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors():
            # a value emptied by a missing variable is already reported as such
            problems.extend(p for p in _describe(error) if p[0] not in env_locs)
    if problems:
        raise PolicyFileError([f"{source}:{_line(lines, loc)}: {format_path(loc)}: {msg}" for loc, msg in problems])
    assert config is not None
    return config


# ---------------------------------------------------------------------- YAML positions
def _index_lines(node: yaml.Node, loc: Loc, lines: dict[Loc, int], problems: list[tuple[Loc, str]]) -> None:
    lines[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                problems.append(((*loc, key), f"duplicate key (line {key_node.start_mark.line + 1})"))
            seen.add(key)
            lines[(*loc, key)] = key_node.start_mark.line + 1
            _index_lines(value_node, (*loc, key), lines, problems)
            lines[(*loc, key)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_lines(item, (*loc, i), lines, problems)


def _line(lines: dict[Loc, int], loc: Loc) -> int:
    while loc not in lines and loc:
        loc = loc[:-1]
    return lines.get(loc, 1)


# ---------------------------------------------------------------------- ${ENV}
def _resolve_env(value: Any, loc: Loc, env: Mapping[str, str], problems: list[tuple[Loc, str]]) -> Any:
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            problems.append((loc, f"environment variable {name} is not set (referenced as ${{{name}}})"))
            return ""

        return _ENV.sub(substitute, value) if "${" in value else value
    if isinstance(value, dict):
        return {k: _resolve_env(v, (*loc, k), env, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_env(v, (*loc, i), env, problems) for i, v in enumerate(value)]
    return value


# ---------------------------------------------------------------------- pydantic errors -> messages
def _describe(error: Any) -> list[tuple[Loc, str]]:
    loc: Loc = tuple(error["loc"])
    kind = error["type"]
    ctx = error.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, ReferenceErrors):
        return [(path, message) for path, message in cause.problems]
    got = error.get("input")
    if kind == "missing":
        return [(loc, "required field is missing")]
    if kind == "extra_forbidden":
        allowed = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        hint += f" (expected one of: {', '.join(allowed)})" if allowed else ""
        return [(loc, f"unknown field{hint}")]
    if kind in ("value_error", "assertion_error"):
        return [(loc, str(error["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, "))]
    message = str(error["msg"]).replace("Input should be ", "expected ", 1)
    if message.startswith("expected a valid "):
        message = "expected " + _article(message.removeprefix("expected a valid ").split(",")[0])
    return [(loc, f"{message}, got {got!r}")]


def _article(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _fields_at(loc: Loc) -> list[str]:
    """Field names of the schema model found at `loc` (for "unknown field" hints)."""
    annotation: Any = PoliciesConfig
    for part in loc:
        model = _model_in(annotation)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            annotation = model.model_fields[part].annotation
            continue
        args = [a for a in typing.get_args(_strip_optional(annotation))]
        if not args:
            return []
        annotation = args[-1]  # list[X] -> X, dict[str, X] -> X
    model = _model_in(annotation)
    return sorted(model.model_fields) if model is not None else []


def _strip_optional(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return members[0] if len(members) == 1 else annotation
    return annotation


def _model_in(annotation: Any) -> type[BaseModel] | None:
    annotation = _strip_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None

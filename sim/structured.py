"""JSON values that satisfy a JSON Schema: what the simulated model emits for tool-call arguments,
`response_format: json_schema` and `json_object` (vLLM constrains decoding with a grammar; the
simulator draws a conforming value directly).

Covers the keywords clients' schemas use (pydantic's and OpenAI's strict mode included): `type`
(one or a list), `enum`, `const`, `properties` / `required` / `additionalProperties`, `items` /
`prefixItems` / `minItems` / `maxItems`, `minLength` / `maxLength`, `minimum` / `maximum` /
`exclusiveMinimum` / `exclusiveMaximum` / `multipleOf`, `anyOf` / `oneOf` (one branch), `allOf`
(merged), `$ref` into `$defs` / `definitions`, common string `format`s. Optional properties are
included about half the time; strings are words of the simulator's vocabulary; recursion is cut
at a fixed depth (the optional parts first). A schema that recurses without end (a required property
or an `anyOf` branch that `$ref`s back to itself) is cut too: past `CUT_DEPTH` levels a value is the
smallest of its type (`{}`, `[]`, `""`, 0, false, null), and so is every value past the first
`MAX_VALUES` of one document (a recursion that branches), so generation always ends, bounded.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

_WORDS = (
    "alpha", "river", "stone", "light", "cloud", "green", "north", "paper", "table", "music",
    "water", "field", "quick", "silver", "market", "garden", "window", "letter", "story", "power",
)  # fmt: skip
_FORMATS = {
    "date-time": "2024-05-17T09:30:00Z",
    "date": "2024-05-17",
    "time": "09:30:00",
    "email": "user@example.com",
    "uri": "https://example.com/item",
    "url": "https://example.com/item",
    "uuid": "123e4567-e89b-42d3-a456-426614174000",
    "ipv4": "192.0.2.1",
    "hostname": "example.com",
}
MAX_DEPTH = 6
CUT_DEPTH = 4 * MAX_DEPTH  # required parts recurse past MAX_DEPTH; nothing recurses past this
MAX_VALUES = 20_000  # values one generated document may hold (a schema can branch exponentially)
_SMALLEST: dict[str, Any] = {"object": {}, "array": [], "string": "", "integer": 0, "number": 0, "boolean": False}


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    seen = 0
    while isinstance(schema.get("$ref"), str) and seen < 16:
        ref = str(schema["$ref"])
        target: Any = root
        if not ref.startswith("#"):
            return {}
        for key in filter(None, ref[1:].split("/")):
            target = target.get(key.replace("~1", "/").replace("~0", "~")) if isinstance(target, Mapping) else None
        if not isinstance(target, Mapping):
            return {}
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **rest}
        seen += 1
    return schema


def _merge_all_of(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    parts = schema.get("allOf")
    if not isinstance(parts, list):
        return schema
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    for part in parts:
        if not isinstance(part, Mapping):
            continue
        part = _resolve(part, root)
        for key, value in part.items():
            if key == "properties" and isinstance(value, Mapping):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []), *value]
            else:
                merged.setdefault(key, value)
    return merged


def _words(rng: random.Random, count: int) -> str:
    return " ".join(_WORDS[rng.randrange(len(_WORDS))] for _ in range(max(count, 1)))


def _string(schema: Mapping[str, Any], rng: random.Random) -> str:
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    low = int(schema.get("minLength") or 0)
    high = schema.get("maxLength")
    text = _words(rng, rng.randint(1, 4))
    while len(text) < low:
        text += " " + _words(rng, 2)
    if isinstance(high, int):
        text = text[:high]
    return text


def _number(schema: Mapping[str, Any], rng: random.Random, integer: bool) -> int | float:
    low, high = schema.get("minimum"), schema.get("maximum")
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    lo = float(low) if isinstance(low, int | float) else (float(ex_low) + 1 if isinstance(ex_low, int | float) else 0.0)
    hi = (
        float(high)
        if isinstance(high, int | float)
        else (float(ex_high) - 1 if isinstance(ex_high, int | float) else lo + 100)
    )
    hi = max(hi, lo)
    step = schema.get("multipleOf")
    if isinstance(step, int | float) and step > 0:
        first = -(-lo // step) * step
        count = int((hi - first) // step)
        value = first + step * rng.randint(0, max(count, 0))
        return int(value) if integer else value
    if integer:
        return rng.randint(int(-(-lo // 1)), max(int(hi // 1), int(-(-lo // 1))))
    return round(rng.uniform(lo, hi), 2)


def _object(
    schema: Mapping[str, Any], rng: random.Random, root: Mapping[str, Any], depth: int, left: list[int]
) -> dict[str, Any]:
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = set(schema.get("required") or ())
    out: dict[str, Any] = {}
    for name, sub in properties.items():
        if name in required or (depth < MAX_DEPTH - 2 and rng.random() < 0.5):
            out[name] = generate(sub if isinstance(sub, Mapping) else {}, rng, root, depth + 1, _left=left)
    if not properties and schema.get("additionalProperties") not in (False, None) and depth < MAX_DEPTH:
        extra = schema.get("additionalProperties")
        sub_schema = extra if isinstance(extra, Mapping) else {"type": "string"}
        for _ in range(rng.randint(1, 3)):
            out[_WORDS[rng.randrange(len(_WORDS))]] = generate(sub_schema, rng, root, depth + 1, _left=left)
    return out


def _array(
    schema: Mapping[str, Any], rng: random.Random, root: Mapping[str, Any], depth: int, left: list[int]
) -> list[Any]:
    prefix = schema.get("prefixItems")
    items = schema.get("items")
    low = int(schema.get("minItems") or 0)
    high = schema.get("maxItems")
    count = max(low, rng.randint(1, 3) if depth < MAX_DEPTH else 0)
    if isinstance(high, int):
        count = min(count, high)
    out: list[Any] = []
    if isinstance(prefix, list):
        out = [generate(p if isinstance(p, Mapping) else {}, rng, root, depth + 1, _left=left) for p in prefix]
        if items is False:
            return out
    item_schema = items if isinstance(items, Mapping) else {"type": "string"}
    while len(out) < count and left[0] > 0:  # a huge minItems ends with the document's budget
        out.append(generate(item_schema, rng, root, depth + 1, _left=left))
    return out


def generate(
    schema: Mapping[str, Any],
    rng: random.Random,
    root: Mapping[str, Any] | None = None,
    depth: int = 0,
    *,
    _left: list[int] | None = None,
) -> Any:
    """A value valid against `schema` (a subset of JSON Schema; unknown keywords are ignored).
    `_left` counts the values one call may still make (MAX_VALUES), shared by its recursion."""
    root = schema if root is None else root
    left = [MAX_VALUES] if _left is None else _left
    schema = _merge_all_of(_resolve(schema, root), root)
    left[0] -= 1
    if depth > CUT_DEPTH or left[0] < 0:
        return _smallest(schema)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[rng.randrange(len(enum))]
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            usable = [b for b in branches if isinstance(b, Mapping)]
            if depth >= MAX_DEPTH:  # prefer a branch that ends the recursion
                usable = [b for b in usable if b.get("type") == "null"] or usable
            if usable:
                base = {k: v for k, v in schema.items() if k != key}
                branch = usable[rng.randrange(len(usable))]
                # a branch that refers elsewhere may refer back here: it counts as a level
                return generate({**base, **branch}, rng, root, depth + 1 if "$ref" in branch else depth, _left=left)
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if isinstance(k, str)]
        if depth >= MAX_DEPTH and "null" in kinds:
            kind = "null"
        else:
            kind = next((k for k in kinds if k != "null"), "null") if kinds else None
    if kind is None:
        if "properties" in schema:
            kind = "object"
        elif "items" in schema:
            kind = "array"
        else:
            kind = "object" if depth == 0 else "string"
    if kind == "object":
        return _object(schema, rng, root, depth, left)
    if kind == "array":
        return _array(schema, rng, root, depth, left)
    if kind == "string":
        return _string(schema, rng)
    if kind == "integer":
        return _number(schema, rng, integer=True)
    if kind == "number":
        return _number(schema, rng, integer=False)
    if kind == "boolean":
        return rng.random() < 0.5
    return None


def _smallest(schema: Mapping[str, Any]) -> Any:
    """The smallest value of the schema's (first) type: where a recursion is cut."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = "null" if "null" in kind else next((k for k in kind if isinstance(k, str)), None)
    if kind is None:
        kind = "object" if "properties" in schema else ("array" if "items" in schema else None)
    value = _SMALLEST.get(kind) if isinstance(kind, str) else None
    return type(value)() if isinstance(value, dict | list) else value


def free_object(rng: random.Random) -> dict[str, Any]:
    """What `json_object` mode says when no schema was given: a small flat object."""
    keys = rng.sample(_WORDS, rng.randint(2, 4))
    return {key: (_words(rng, rng.randint(1, 3)) if rng.random() < 0.7 else rng.randint(0, 99)) for key in keys}

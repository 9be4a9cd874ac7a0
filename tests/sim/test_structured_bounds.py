"""The simulated engine's structured output ends, bounded, whatever the schema: a `$ref` that recurses
through a required property, an `anyOf` or a branching array is cut, never a RecursionError (a 500)."""

from __future__ import annotations

import random
import sys
from typing import Any

import orjson
import pytest

from sim.outputs import CUT_DEPTH, MAX_VALUES, generate

SCHEMAS = [
    pytest.param({"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}, id="required-self"),
    pytest.param({"anyOf": [{"$ref": "#"}]}, id="anyof-self"),
    pytest.param({"$ref": "#"}, id="ref-root"),
    pytest.param(
        {
            "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
            "$ref": "#/$defs/a",
        },
        id="mutual",
    ),
    pytest.param({"type": "array", "items": {"$ref": "#"}, "minItems": 3}, id="branching-array"),
    pytest.param(
        {"type": "object", "properties": {"l": {"$ref": "#"}, "r": {"$ref": "#"}}, "required": ["l", "r"]},
        id="binary-tree",
    ),
    pytest.param({"type": "array", "items": {"type": "integer"}, "minItems": 10**9}, id="huge-min-items"),
]


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.slow
def test_a_recursive_schema_generates_a_bounded_value(schema: dict[str, Any]) -> None:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(500)  # far below what an unbounded recursion would need
    try:
        for seed in range(5):
            value = generate(schema, random.Random(seed))
            assert depth(value) <= CUT_DEPTH + 2
            assert len(orjson.dumps(value)) < MAX_VALUES * 64  # encodable, and bounded in size
    finally:
        sys.setrecursionlimit(limit)


def test_an_ordinary_schema_is_unchanged_by_the_bounds() -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
    }
    value = generate(schema, random.Random(1))
    assert isinstance(value["name"], str) and value["name"]
    assert all(isinstance(t, str) for t in value["tags"]) and value["tags"]

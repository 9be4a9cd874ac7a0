"""The adapter registry: one entry per engine kind of the config schema, read-only, clear errors."""

from __future__ import annotations

from typing import get_args

import pytest

from backends.adapters.base import PRIORITY_MAX, PRIORITY_MIN
from backends.config import EngineKind
from backends.fleet import ADAPTERS, get_adapter
from policies.schema import PRIORITY_VALUES


def test_every_engine_kind_has_an_adapter() -> None:
    assert set(ADAPTERS) == set(get_args(EngineKind))
    for kind, adapter in ADAPTERS.items():
        assert adapter.kind == kind


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        ADAPTERS["x"] = ADAPTERS["vllm"]  # type: ignore[index]


def test_unknown_kind_names_the_known_ones() -> None:
    known = "anthropic, azure-openai, bedrock, gemini, openai, sim, trtllm, vllm, vllm-ascend"
    with pytest.raises(KeyError, match=rf"sglang.*known: {known}"):
        get_adapter("sglang")


def test_priority_scale_matches_the_policy_schema() -> None:
    scale = sorted(PRIORITY_VALUES.values())
    assert scale[0] == PRIORITY_MIN and scale[-1] == PRIORITY_MAX

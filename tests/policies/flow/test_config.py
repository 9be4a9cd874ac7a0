"""gateway.yaml `flow_control` and policies.yaml `flow_control` / tenant weights."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policies.flow.saturation import FlowSettings, ReserveSize
from policies.loader import parse_config
from policies.policy import Policy


def test_pool_overrides_only_the_fields_it_sets() -> None:
    settings = FlowSettings.model_validate(
        {"saturation": {"max_kv_usage_ratio": 0.9}, "pools": {"llama": {"saturation": {"max_engine_waiting": 0}}}}
    )
    llama = settings.limits("llama", max_num_seqs=8)
    assert (llama.max_engine_waiting, llama.max_kv_usage_ratio, llama.max_num_seqs) == (0, 0.9, 8)
    other = settings.limits("qwen")
    assert (other.max_engine_waiting, other.max_kv_usage_ratio) == (5, 0.9)


def test_disabled_turns_every_limit_off() -> None:
    limits = FlowSettings(enabled=False).limits("any")
    assert (limits.max_engine_waiting, limits.max_kv_usage_ratio, limits.max_inflight) == (None, None, None)
    assert not limits.reserve.enabled


def test_the_reserve_is_fixed_unless_a_larger_max_is_set_per_pool_or_for_all() -> None:
    settings = FlowSettings.model_validate(
        {
            "saturation": {"reserve_slots": 2},
            "pools": {"llama": {"saturation": {"reserve_max_slots": 10, "reserve_margin": 3}}},
        }
    )
    assert settings.limits("qwen", 8).reserve == ReserveSize(2, None, 1)  # fixed: the default until asked
    assert settings.limits("llama", 8).reserve == ReserveSize(2, 10, 3)
    with pytest.raises(ValidationError):
        FlowSettings.model_validate({"saturation": {"reserve_margin": -1}})


def test_room_size_per_pool() -> None:
    settings = FlowSettings.model_validate({"max_queued": 100, "pools": {"small": {"max_queued": 3}}})
    assert settings.room("small") == (3, settings.max_queued_bytes)
    assert settings.room("other") == (100, settings.max_queued_bytes)
    with pytest.raises(ValidationError):
        FlowSettings.model_validate({"saturation": {"max_kv_usage_ratio": 1.5}})


def test_policy_weights_and_bands() -> None:
    config = parse_config(
        """
tenants:
  heavy: {weight: 3}
  light: {}
flow_control:
  shortest_job_first: true
  bands:
    normal: {max_queue_ms: 2500, on_timeout: "429"}
    sheddable: {max_queue_ms: 100, on_timeout: fallback}
"""
    )
    policy = Policy(config)
    assert policy.tenant_weight("heavy") == 3.0 and policy.tenant_weight("light") == 1.0
    assert policy.tenant_weight("unknown") == 1.0
    flow = config.flow_control
    assert flow.shortest_job_first
    assert (flow.band("normal").max_queue_ms, flow.band("normal").on_timeout) == (2500, 429)
    assert flow.band("sheddable").on_timeout == "fallback"
    assert (flow.band("critical").max_queue_ms, flow.band("critical").on_timeout) == (30_000, 503)  # default


@pytest.mark.parametrize(
    "text",
    [
        "tenants: {t: {weight: 0}}",
        "flow_control: {bands: {normal: {max_queue_ms: 10, on_timeout: 404}}}",
        "flow_control: {bands: {urgent: {max_queue_ms: 10}}}",
    ],
    ids=["zero-weight", "unknown-status", "unknown-band"],
)
def test_bad_flow_policy_is_refused_with_its_path(text: str) -> None:
    with pytest.raises(Exception) as info:
        parse_config(text)
    assert "flow_control" in str(info.value) or "weight" in str(info.value)

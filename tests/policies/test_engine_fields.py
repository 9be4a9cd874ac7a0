"""Engine-control fields are dropped from client bodies unless the tenant may set them."""

from __future__ import annotations

from policies.engine_fields import ENGINE_CONTROL_FIELDS, client_body

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_body_without_engine_fields_is_passed_as_it_is() -> None:
    body, dropped = client_body(BODY)
    assert body is BODY and dropped == ()


def test_engine_control_fields_are_dropped() -> None:
    hostile = {
        **BODY,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 5600},
        "disaggregated_params": {"request_type": "generation_only"},
        "priority": -100,
        "cache_salt": "x",
        "vllm_xargs": {"kv_cache_report_mode": "full"},
        "lora_request": {"lora_path": "/etc"},
        "temperature": 0.5,
    }
    body, dropped = client_body(hostile)
    assert set(body) == {"model", "messages", "temperature"}
    assert set(dropped) <= ENGINE_CONTROL_FIELDS and "kv_transfer_params" in dropped


def test_a_tenant_may_be_allowed_named_fields() -> None:
    body, dropped = client_body({**BODY, "priority": 1, "cache_salt": "s"}, allowed=("cache_salt",))
    assert body["cache_salt"] == "s" and "priority" not in body and dropped == ("priority",)

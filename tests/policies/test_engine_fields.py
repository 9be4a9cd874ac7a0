"""Engine-control fields are dropped from client bodies unless the tenant may set them."""

from __future__ import annotations

from policies.policy import cache_salt, client_body
from policies.schema import ENGINE_CONTROL_FIELDS

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


def test_each_cache_group_has_its_own_salt_which_does_not_spell_its_name() -> None:
    a, b = cache_salt("tenant:acme"), cache_salt("tenant:globex")
    assert a != b and a == cache_salt("tenant:acme")  # stable: the same on every gateway replica
    assert "acme" not in a and len(a) == 32


def test_a_trusted_tenants_own_salt_splits_its_group_but_never_names_another() -> None:
    mine = cache_salt("tenant:acme", "experiment-1")
    assert mine not in (cache_salt("tenant:acme"), cache_salt("tenant:acme", "experiment-2"))
    # whatever salt a tenant picks, it cannot land on another group's: the group is length-prefixed
    assert cache_salt("tenant:a", "b") != cache_salt("tenant:ab")

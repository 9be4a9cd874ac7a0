"""`models:` entries of `kind: adapter`: what they need, what they may reference, what the policy makes of them."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from policies.policy import Policy, hash_key
from policies.schema import PoliciesConfig


def doc(**models: Any) -> dict[str, Any]:
    return {
        "tenants": {"t": {}, "u": {}},
        "keys": [{"id": "k", "tenant": "t", "sha256": hash_key("x")}],
        "models": {"base": {"aliases": ["b"]}, **models},
    }


def test_an_adapter_compiles_to_its_base_model_and_source() -> None:
    config = PoliciesConfig.model_validate(
        doc(sql={"kind": "adapter", "base": "b", "source": "s3://x/sql", "size_mb": 32, "aliases": ["sql-v1"]})
    )
    policy = Policy(config)
    adapter = policy.adapters["sql"]
    assert (adapter.base_model, adapter.source, adapter.size_bytes) == ("base", "s3://x/sql", 32 * 1024 * 1024)
    assert policy.resolve_model("sql-v1") == "sql"  # aliases work as for models
    assert "base" not in policy.adapters


def test_adapter_tenants_narrow_who_may_call_it() -> None:
    policy = Policy(
        PoliciesConfig.model_validate(doc(sql={"kind": "adapter", "base": "base", "source": "/a", "tenants": ["u"]}))
    )
    assert policy.adapter_allows("sql", "u") and not policy.adapter_allows("sql", "t")
    assert policy.adapter_allows("base", "t")


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"kind": "adapter", "source": "/a"}, "an adapter needs base"),
        ({"kind": "adapter", "base": "base"}, "an adapter needs source"),
        ({"base": "base"}, "only apply to kind: adapter"),
        ({"preload": True}, "preload only apply to kind: adapter"),
        ({"idle_unload_s": 60}, "idle_unload_s only apply to kind: adapter"),
        ({"kind": "adapter", "base": "base", "source": "/a", "idle_unload_s": 0}, "greater than 0"),
        ({"kind": "adapter", "base": "nope", "source": "/a"}, "unknown model 'nope'"),
        ({"kind": "adapter", "base": "base", "source": "/a", "tenants": ["zz"]}, "unknown tenant 'zz'"),
    ],
)
def test_invalid_adapters_are_refused_with_a_reason(entry: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        PoliciesConfig.model_validate(doc(sql=entry))


def test_an_adapter_of_an_adapter_is_refused() -> None:
    with pytest.raises(ValidationError, match="is an adapter; name its base model"):
        PoliciesConfig.model_validate(
            doc(
                sql={"kind": "adapter", "base": "base", "source": "/a"},
                sql2={"kind": "adapter", "base": "sql", "source": "/b"},
            )
        )


def test_preload_and_idle_unload_reach_the_fleet_view() -> None:
    config = PoliciesConfig.model_validate(
        doc(
            hot={"kind": "adapter", "base": "base", "source": "/a", "preload": True},
            cold={"kind": "adapter", "base": "base", "source": "/b", "idle_unload_s": 120},
        )
    )
    adapters = Policy(config).adapters
    assert (adapters["hot"].preload, adapters["hot"].idle_unload_s) == (True, None)
    assert (adapters["cold"].preload, adapters["cold"].idle_unload_s) == (False, 120.0)

"""Cross-file checks: each case one mistake between gateway.yaml and policies.yaml, named."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gateway.app.checks import config_findings, errors
from gateway.app.settings import GatewaySettings
from policies.loader import parse_config


def settings(**server: Any) -> GatewaySettings:
    pools = [
        {"name": "llama", "model": "llama-3.1-8b", "engine": "vllm", "endpoints": [{"url": "http://127.0.0.1:1"}]},
        {"name": "hosted", "model": "gpt-4o-mini", "engine": "openai", "endpoints": [{"url": "https://x.example"}]},
    ]
    return GatewaySettings.model_validate({"server": server, "pools": pools, "source": "gateway.yaml"})


PRICED = {"price": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}}


def findings(policy: dict[str, Any], gateway: GatewaySettings | None = None) -> list[str]:
    config = parse_config(yaml.safe_dump(policy))
    return [str(f) for f in config_findings(gateway or settings(), config, "policies.yaml")]


def test_a_clean_pair_has_no_findings() -> None:
    assert findings({"models": {"llama-3.1-8b": PRICED, "gpt-4o-mini": PRICED}}) == []


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        pytest.param(
            {"models": {"llama-3.1-8b": {**PRICED, "aliases": ["gpt-4o-mini"]}}},
            "error: policies.yaml: models.llama-3.1-8b.aliases[0]: alias 'gpt-4o-mini' shadows pool 'hosted'",
            id="alias-shadows-a-pool",
        ),
        pytest.param(
            {"models": {"llama-3.1-8b": {**PRICED, "fallbacks": ["qwen"]}, "gpt-4o-mini": PRICED, "qwen": PRICED}},
            "warning: policies.yaml: models.llama-3.1-8b.fallbacks[0].model: fallback target 'qwen' has no pool",
            id="fallback-without-pool",
        ),
        pytest.param(
            {"models": {"llama-3.1-8b": PRICED}},
            "warning: gateway.yaml: pools[1].model: pool 'hosted' serves 'gpt-4o-mini', which policies.yaml does not",
            id="pool-without-policy-entry",
        ),
        pytest.param(
            {"models": {"llama-3.1-8b": PRICED, "gpt-4o-mini": {}}},
            "warning: gateway.yaml: pools[1].model: model 'gpt-4o-mini' of pool 'hosted' has no price",
            id="pool-without-price",
        ),
        pytest.param(
            {"models": {"llama-3.1-8b": PRICED, "gpt-4o-mini": PRICED}, "tenants": {"t": {"models": ["gpt-5"]}}},
            "warning: policies.yaml: tenants.t.models[0]: unknown model 'gpt-5'",
            id="tenant-allows-unknown-model",
        ),
        pytest.param(
            {
                "models": {"llama-3.1-8b": PRICED, "gpt-4o-mini": PRICED, "qwen": PRICED},
                "tenants": {"t": {}},
                "limits": [{"scope": "key_model", "match": {"tenant": "t", "model": "qwen"}, "rpm": 1}],
            },
            "warning: policies.yaml: limits[0].match.model: model 'qwen' has no pool",
            id="tenant-limit-on-unserved-model",
        ),
    ],
)
def test_each_mistake_is_named(policy: dict[str, Any], expected: str) -> None:
    found = findings(policy)
    assert any(f.startswith(expected) for f in found), found


def test_an_unknown_default_pool_is_an_error() -> None:
    gateway = settings(ready_when="default_pool", default_pool="nope")
    config = parse_config(yaml.safe_dump({"models": {"llama-3.1-8b": PRICED, "gpt-4o-mini": PRICED}}))
    found = errors(config_findings(gateway, config))
    assert [f.where for f in found] == ["gateway.yaml: server.default_pool"]

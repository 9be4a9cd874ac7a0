"""Cross-file checks: each case one mistake between gateway.yaml and policies.yaml, named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.app.checks import check_files, config_findings, errors
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
    # a pool's own price prices it: the model needs none of its own
    assert (
        findings({"models": {"llama-3.1-8b": PRICED, "gpt-4o-mini": {"pool_prices": {"hosted": PRICED["price"]}}}})
        == []
    )


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
            {"models": {"llama-3.1-8b": PRICED, "gpt-4o-mini": {**PRICED, "pool_prices": {"llama": PRICED["price"]}}}},
            "warning: policies.yaml: models.gpt-4o-mini.pool_prices.llama: no pool 'llama' serves 'gpt-4o-mini'",
            id="pool-price-for-a-pool-of-another-model",
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


def check(tmp_path: Path, pool: dict[str, Any]) -> list[str]:
    """`tokenway check` on a gateway.yaml with this one pool (and a policies.yaml pricing its model)."""
    (tmp_path / "policies.yaml").write_text(yaml.safe_dump({"models": {"m": PRICED}}))
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({"pools": [{"name": "p", "model": "m", **pool}]}))
    return [str(f) for f in check_files(str(tmp_path / "gateway.yaml"), probe=False)]


def test_check_refuses_a_simulator_preset_the_engine_would_refuse(tmp_path: Path) -> None:
    """The sim resolves its preset only when it starts: `check` (and the load) must say so first."""
    assert check(tmp_path, {"engine": "sim", "replicas": 1, "preset": "llama-3.1-8b@h100"}) == []
    found = check(tmp_path, {"engine": "sim", "replicas": 1, "preset": "lama-3.1-8b@h100"})
    assert len(found) == 1 and found[0].startswith("error: ")
    assert "pools[0].preset" in found[0] and "did you mean 'llama-3.1-8b@h100'?" in found[0]
    found = check(tmp_path, {"engine": "sim", "replicas": 1, "preset": "llama-3.1-8b@h100", "tensor_parallel": 3})
    assert "pools[0].preset" in found[0] and "does not divide" in found[0]


def test_check_names_the_nearest_key_of_a_misspelled_one(tmp_path: Path) -> None:
    found = check(tmp_path, {"engine": "sim", "replica": 1})
    assert any("pools[0].replica: unknown key; did you mean 'replicas'?" in f for f in found), found


def test_check_refuses_engine_options_the_engine_has_not(tmp_path: Path) -> None:
    """What an adapter refuses at launch (a flag the engine does not take) is an error of `check`."""
    found = check(tmp_path, {"engine": "vllm", "replicas": 1, "devices": [0], "engine_config": {"x": 1}})
    assert any(f.startswith("error: ") and "takes no `engine_config`" in f for f in found), found


def test_check_names_the_nearest_key_in_policies_yaml_too(tmp_path: Path) -> None:
    check(tmp_path, {"engine": "sim", "replicas": 1})
    (tmp_path / "policies.yaml").write_text(yaml.safe_dump({"limits": [{"id": "l", "scope": "key", "rpn": 5}]}))
    found = [str(f) for f in check_files(str(tmp_path / "gateway.yaml"), probe=False)]
    assert any("limits[0].rpn: unknown field; did you mean 'rpm'?" in f for f in found), found


def test_the_check_command_prints_the_suggestion_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.app.cli import main

    check(tmp_path, {"engine": "sim", "replicas": 1, "preset": "llama-3.1-8b@h10"})
    assert main(["check", "--config", str(tmp_path / "gateway.yaml"), "--no-probe"]) == 1
    err = capsys.readouterr().err
    assert "pools[0].preset" in err and "did you mean 'llama-3.1-8b@h100'?" in err


def test_check_refuses_a_simulated_engine_that_would_not_start(tmp_path: Path) -> None:
    """Where vLLM (and so the sim) refuses to start, the same performance model says so before."""
    found = check(tmp_path, {"engine": "sim", "replicas": 1, "preset": "llama-3.1-70b@h100"})
    assert len(found) == 1 and "would refuse to start" in found[0] and "no memory left" in found[0], found
    found = check(tmp_path, {"engine": "sim", "replicas": 1, "max_model_len": 10_000_000})
    assert len(found) == 1 and "max_model_len 10000000 is larger than the KV cache" in found[0], found
    assert check(tmp_path, {"engine": "sim", "replicas": 1, "preset": "llama-3.1-70b@h100", "tensor_parallel": 4}) == []
    # a sim behind a static endpoint is not launched here: nothing to refuse
    assert (
        check(tmp_path, {"engine": "sim", "preset": "llama-3.1-70b@h100", "endpoints": [{"url": "http://h:1"}]}) == []
    )


def test_check_names_every_pool_an_engine_refuses(tmp_path: Path) -> None:
    pools = [
        {"name": "a", "model": "m", "engine": "sim", "replicas": 1, "engine_config": {"x": 1}},
        {"name": "b", "model": "m", "engine": "trtllm", "replicas": 1, "devices": [0], "api_key": "k"},
    ]
    (tmp_path / "policies.yaml").write_text(yaml.safe_dump({"models": {"m": PRICED}}))
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({"pools": pools}))
    found = errors(check_files(str(tmp_path / "gateway.yaml"), probe=False))
    assert [f.where.rsplit(": ", 1)[1] for f in found] == ["pools[0]", "pools[1]"], found
    assert "takes no `engine_config`" in found[0].message and "no --api-key" in found[1].message


ADAPTER = {"kind": "adapter", "base": "llama-3.1-8b", "source": "/adapters/sql", **PRICED}


def test_a_pool_serving_adapters_without_adapter_routing_is_warned() -> None:
    policy = {"models": {"llama-3.1-8b": PRICED, "gpt-4o-mini": PRICED, "sql-lora": ADAPTER}}
    assert findings(policy) == [
        "warning: gateway.yaml: pools[0]: pool 'llama' serves the base model of LoRA adapters (sql-lora) but its "
        "routing pipeline has no lora-affinity scorer (and lora-slots filter): adapter requests ignore which "
        "replica holds them (docs/adapters.md)"
    ]
    pools = settings().model_dump()["pools"]
    routing = {"pools": {"llama": {"scorers": [{"type": "lora-affinity"}], "filters": [{"type": "lora-slots"}]}}}
    routed = GatewaySettings.model_validate({"pools": pools, "routing": routing, "source": "gateway.yaml"})
    assert findings(policy, routed) == []

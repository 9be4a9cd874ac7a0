"""An adapter's size against a pool's LoRA memory budget where it is visible before any request: its
files' size when its source is a local path (compiled into the policy), and `tokenway check`, which
refuses an adapter no pool serving its base can hold and warns about pools that cannot; at request
time the dispatch keeps the pools that can hold it and answers 400 when none can."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.config import PoolConfig
from backends.fleet import MB, LoraAdapter, Pool, local_size_bytes, too_large
from gateway.app.checks import config_findings
from gateway.app.settings import GatewaySettings
from gateway.request.director import Detour, fitting_pools
from policies.loader import parse_config
from policies.policy import compile_adapters

PRICED = {"price": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}}
LORA_ROUTING = {"scorers": [{"type": "lora-affinity"}], "filters": [{"type": "lora-slots"}]}


def _settings(*budgets: float | None) -> GatewaySettings:
    pools = [
        {
            "name": f"llama{i}",
            "model": "llama-3.1-8b",
            "engine": "vllm",
            "endpoints": [{"url": "http://127.0.0.1:1"}],
            "lora_memory_budget_mb": budget,
        }
        for i, budget in enumerate(budgets)
    ]
    routing = {"pools": {p["name"]: LORA_ROUTING for p in pools}}
    return GatewaySettings.model_validate({"pools": pools, "routing": routing, "source": "gateway.yaml"})


def _findings(adapter: dict[str, Any], gateway: GatewaySettings) -> list[str]:
    policy = {"models": {"llama-3.1-8b": PRICED, "sql-lora": {"kind": "adapter", "base": "llama-3.1-8b", **adapter}}}
    return [str(f) for f in config_findings(gateway, parse_config(yaml.safe_dump(policy)), "policies.yaml")]


def test_a_local_adapters_size_is_its_files(tmp_path: Path) -> None:
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x" * 3000)
    (tmp_path / "adapter_config.json").write_bytes(b"{}")
    assert local_size_bytes(str(tmp_path)) == 3002
    assert local_size_bytes(str(tmp_path / "adapter_config.json")) == 2
    assert local_size_bytes("s3://adapters/sql") is None and local_size_bytes(str(tmp_path / "nope")) is None
    assert local_size_bytes("relative/path") is None  # only the engine knows what that is relative to
    policy = {
        "models": {
            "base": {},
            "local": {"kind": "adapter", "base": "base", "source": str(tmp_path)},
            "sized": {"kind": "adapter", "base": "base", "source": str(tmp_path), "size_mb": 2},
        }
    }
    adapters = compile_adapters(parse_config(yaml.safe_dump(policy)))
    assert adapters["local"].size_bytes == 3002 and adapters["sized"].size_bytes == 2 * MB  # the policy's wins


def test_too_large_only_when_no_pool_can_hold_it() -> None:
    big = LoraAdapter("big", "base", "s3://x", 300 * MB)
    assert too_large(big, [("a", 256 * MB), ("b", None)]) is None  # b has no budget
    assert too_large(big, [("a", 512 * MB)]) is None
    assert too_large(LoraAdapter("unsized", "base", "s3://x"), [("a", 1)]) is None
    refusal = too_large(big, [("a", 256 * MB), ("b", 128 * MB)])
    assert refusal is not None and "'big' (300 MB)" in refusal and "a (256 MB), b (128 MB)" in refusal


def test_check_refuses_an_adapter_no_pool_can_hold(tmp_path: Path) -> None:
    assert _findings({"source": "s3://a/sql", "size_mb": 64}, _settings(128)) == []
    assert _findings({"source": "s3://a/sql"}, _settings(1)) == []  # size unknown: nothing to say
    (found,) = _findings({"source": "s3://a/sql", "size_mb": 300}, _settings(256))
    assert found == (
        "error: policies.yaml: models.sql-lora: adapter 'sql-lora' (300 MB) is larger than the LoRA memory budget "
        "(lora_memory_budget_mb) of llama0 (256 MB): every request for it would be refused"
    )
    (some,) = _findings({"source": "s3://a/sql", "size_mb": 300}, _settings(256, None))
    assert some.startswith("warning: ") and some.endswith("those pools never serve it")
    (tmp_path / "weights").write_bytes(b"x" * (2 * MB))
    (local,) = _findings({"source": str(tmp_path)}, _settings(1))  # its files' size, read here
    assert local.startswith("error: ") and "(2 MB)" in local


def test_dispatch_keeps_the_pools_that_fit_and_refuses_an_adapter_none_can_hold() -> None:
    def pool(name: str, budget: float | None) -> Pool:
        return Pool(
            PoolConfig.model_validate(
                {"name": name, "model": "base", "endpoints": [{"url": "http://x"}], "lora_memory_budget_mb": budget}
            )
        )

    small, roomy, unbounded = pool("small", 128), pool("roomy", 512), pool("unbounded", None)
    big = LoraAdapter("big", "base", "s3://x", 300 * MB)
    assert [p.name for p in fitting_pools(big, [small, roomy, unbounded])] == ["roomy", "unbounded"]
    unsized = LoraAdapter("unsized", "base", "s3://x")
    assert [p.name for p in fitting_pools(unsized, [small])] == ["small"]  # unknown size: the loader decides
    with pytest.raises(Detour) as refused:
        fitting_pools(big, [small])
    error = refused.value.error
    assert not refused.value.fallback
    assert (error.status, error.code, error.param) == (400, "adapter_too_large", "model")
    assert "'big' (300 MB)" in error.message and "small (128 MB)" in error.message

"""Hosted provider pools (engine anthropic / bedrock / gemini / azure-openai): their configuration and adapter."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from backends.adapters.base import Probe
from backends.config import HOSTED_ENGINES, PoolConfig
from backends.fleet import Fleet, get_adapter
from backends.types import PlanError


def pool(**fields: Any) -> PoolConfig:
    return PoolConfig(**{"name": "p", "model": "m", **fields})


def test_provider_defaults_fill_the_endpoint() -> None:
    assert pool(engine="anthropic", api_key_env="ANTHROPIC_API_KEY").endpoints[0].url == "https://api.anthropic.com"
    bedrock = pool(engine="bedrock", region="eu-west-1", served_model_name="anthropic.claude-x")
    assert bedrock.endpoints[0].url == "https://bedrock-runtime.eu-west-1.amazonaws.com"
    assert pool(engine="gemini", api_key_env="K").endpoints[0].url == "https://generativelanguage.googleapis.com"
    vertex = pool(engine="gemini", served_model_name="projects/p/locations/us-central1/publishers/google/models/g")
    assert vertex.endpoints[0].url == "https://us-central1-aiplatform.googleapis.com"
    azure = pool(engine="azure-openai", api_key_env="K", endpoints=[{"url": "https://r.openai.azure.com"}])
    assert azure.endpoints[0].url == "https://r.openai.azure.com"
    assert all(p.hosted and not p.migrates_streams for p in (bedrock, vertex, azure))


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"engine": "anthropic"}, "api_key_env"),
        ({"engine": "anthropic", "api_key": "sk-secret"}, "api_key_env"),
        ({"engine": "anthropic", "api_key_env": "sk-ant-abc-123"}, "api_key_env"),  # a key, not a name
        ({"engine": "anthropic", "api_key_env": "K", "replicas": 1}, "launches nothing"),
        ({"engine": "bedrock"}, "region"),
        ({"engine": "bedrock", "region": "us-east-1", "api_key_env": "K"}, "credential chain"),
        ({"engine": "gemini", "api_key_env": "K", "region": "us-east-1"}, "bedrock"),
        ({"engine": "gemini", "api_key_env": "K", "anthropic_beta": ["x"]}, "anthropic"),
        ({"engine": "azure-openai", "api_key_env": "K"}, "endpoints"),
        ({"engine": "vllm", "replicas": 1, "api_key_env": "K"}, "hosted engines only"),
        ({"engine": "vllm", "replicas": 1, "allow_dropped_fields": True}, "hosted engines only"),
    ],
)
def test_misconfigured_hosted_pools_are_refused(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        pool(**fields)


@pytest.mark.parametrize("kind", sorted(HOSTED_ENGINES))
def test_adapter_launches_nothing_and_probes_nothing(kind: str) -> None:
    adapter = get_adapter(kind)
    assert adapter.kind == kind and not adapter.launches and not adapter.supports_pd
    assert adapter.health_path == ""  # backends/fleet.py makes no call for it
    assert adapter.classify_health(None, {}) is Probe.READY
    cfg = pool(engine="bedrock", region="us-east-1")
    with pytest.raises(PlanError):
        adapter.launch_spec(cfg, None)  # type: ignore[arg-type]


def test_shape_request_takes_out_engine_fields_only() -> None:
    adapter = get_adapter("anthropic")
    body = {"model": "m", "messages": [], "priority": -1, "cache_salt": "s", "kv_transfer_params": {}, "top_k": 5}
    assert adapter.shape_request(body, "chat") == {"model": "m", "messages": [], "top_k": 5}


async def test_health_probe_makes_no_call() -> None:
    from backends.fleet import probe

    fleet = Fleet.from_configs([pool(engine="anthropic", api_key_env="K")])
    endpoint = next(iter(fleet.endpoints()))
    assert await probe(endpoint, None, 1.0) is Probe.READY  # type: ignore[arg-type]  # no session needed

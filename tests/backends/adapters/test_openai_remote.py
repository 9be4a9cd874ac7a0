"""Remote OpenAI-compatible API: no launch, no metrics, OpenAI's fields only, no PD."""

from __future__ import annotations

import pytest

from backends.adapters.base import Probe
from backends.adapters.hosted import OPENAI_REMOTE
from backends.types import EndpointStats, PdUnsupportedError, PlanError
from tests.backends.builders import pool, replica


def test_shape_keeps_only_openai_fields() -> None:
    body = {"model": "gpt-4o-mini", "messages": [], "max_tokens": 5, "priority": 2, "top_k": 3,
            "kv_transfer_params": {}, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    assert OPENAI_REMOTE.shape_request(body, "chat") == {
        "model": "gpt-4o-mini", "messages": [], "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    assert OPENAI_REMOTE.shape_request({"model": "e", "input": "x", "priority": 1}, "embeddings") == {
        "model": "e", "input": "x"}  # fmt: skip


@pytest.mark.parametrize(
    ("status", "probe"), [(None, Probe.FAILING), (200, Probe.READY), (401, Probe.FAILING), (503, Probe.FAILING)],
    ids=["unreachable", "ok", "bad-key", "down"],
)  # fmt: skip
def test_classify_health(status: int | None, probe: Probe) -> None:
    assert OPENAI_REMOTE.classify_health(status, {}) is probe


def test_nothing_to_launch_or_scrape() -> None:
    p = pool(engine="openai", endpoints=[{"url": "https://api.openai.com/v1"}])
    assert not OPENAI_REMOTE.launches and OPENAI_REMOTE.metrics_paths == ()
    with pytest.raises(PlanError):
        OPENAI_REMOTE.launch_spec(p, replica())
    previous = EndpointStats(running=1)
    assert OPENAI_REMOTE.parse_metrics("", previous) is previous


def test_no_pd() -> None:
    with pytest.raises(PdUnsupportedError):
        OPENAI_REMOTE.prefill_leg_body({})
    with pytest.raises(PdUnsupportedError):
        OPENAI_REMOTE.decode_leg_body({}, {})


def test_a_pool_may_forward_more_fields_than_openai_documents() -> None:
    from backends.config import PoolConfig, StaticEndpointConfig

    body = {"model": "m", "messages": [], "top_k": 5, "guided_json": {"type": "object"}, "priority": 1}
    hosted = PoolConfig(
        name="h", model="m", engine="openai", endpoints=[StaticEndpointConfig(url="https://h.example")],
        extra_request_fields=["top_k", "guided_json"],
    )  # fmt: skip
    assert set(OPENAI_REMOTE.shape_request(body, "chat", hosted)) == {"model", "messages", "top_k", "guided_json"}
    everything = hosted.model_copy(update={"extra_request_fields": ["*"]})
    assert OPENAI_REMOTE.shape_request(body, "chat", everything) == body
    with pytest.raises(ValueError, match="only applies to engine `openai`"):
        PoolConfig.model_validate(
            {
                "name": "v",
                "model": "m",
                "engine": "vllm",
                "endpoints": [{"url": "http://v"}],
                "extra_request_fields": ["x"],
            }
        )

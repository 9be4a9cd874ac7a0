"""TensorRT-LLM adapter: golden argv/env/YAML (tensorrt_llm/llmapi/llm_args.py), readiness, both metrics formats,
request shaping for `extra="forbid"` bodies, and the disaggregated_params handshake."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from backends.adapters.base import Probe
from backends.adapters.trtllm import TRTLLM
from backends.types import EndpointStats, MetricsFormatError, PdHandshakeError, Role
from tests.backends.builders import fixture_text, pool, replica


def test_launch_spec_golden_8b() -> None:
    p = pool(model="llama-3.1-8b", engine="trtllm", engine_model="meta-llama/Llama-3.1-8B-Instruct",
             max_model_len=8192, max_num_seqs=128, max_num_batched_tokens=8192)  # fmt: skip
    spec = TRTLLM.launch_spec(p, replica(devices=(0,), run_dir="var/run/engines"))
    assert list(spec.argv) == [
        "trtllm-serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "127.0.0.1", "--port", "8100",
        "--tp_size", "1", "--pp_size", "1", "--max_seq_len", "8192", "--max_batch_size", "128",
        "--max_num_tokens", "8192", "--config", "var/run/engines/p.both-0.trtllm.yaml",
    ]  # fmt: skip
    assert dict(spec.env) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert yaml.safe_load(spec.files["var/run/engines/p.both-0.trtllm.yaml"]) == {
        "kv_cache_config": {"enable_block_reuse": True, "tokens_per_block": 32, "event_buffer_max_size": 0},
        "enable_iter_perf_stats": True,
        "return_perf_metrics": True,
        "scheduler_config": {"waiting_queue_policy": "priority"},
    }  # fmt: skip


def test_host_is_always_explicit() -> None:
    spec = TRTLLM.launch_spec(pool(engine="trtllm"), replica(host="0.0.0.0"))
    assert spec.argv[spec.argv.index("--host") + 1] == "0.0.0.0"  # it defaults to localhost (commands/serve.py)


def test_launch_spec_golden_pd_decode_tp2_with_engine_config() -> None:
    p = pool(engine="trtllm", engine_model="/models/llama-70b", roles={"prefill": 1, "decode": 1},
             tensor_parallel=2, kv_events={"enabled": True}, priority_scheduling=False,
             kv_transfer={"backend": "UCX", "max_tokens_in_buffer": 8192},
             engine_config={"kv_cache_config": {"host_cache_size": 1000000}, "backend": "pytorch"},
             extra_args=["--trust_remote_code"])  # fmt: skip
    spec = TRTLLM.launch_spec(p, replica(role=Role.DECODE, devices=(2, 3), run_dir="/run"))
    assert list(spec.argv) == [
        "trtllm-serve", "/models/llama-70b", "--host", "127.0.0.1", "--port", "8100", "--tp_size", "2",
        "--pp_size", "1", "--config", "/run/p.decode-0.trtllm.yaml", "--server_role", "GENERATION",
        "--trust_remote_code",
    ]  # fmt: skip
    assert dict(spec.env) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert yaml.safe_load(spec.files["/run/p.decode-0.trtllm.yaml"]) == {
        "kv_cache_config": {"enable_block_reuse": True, "tokens_per_block": 32, "event_buffer_max_size": 16384,
                            "host_cache_size": 1000000},
        "enable_iter_perf_stats": True,
        "return_perf_metrics": True,
        "cache_transceiver_config": {"backend": "UCX", "max_tokens_in_buffer": 8192},
        "backend": "pytorch",
    }  # fmt: skip
    assert TRTLLM.served_model(p) == "llama-70b"  # directory basename (commands/serve.py)
    assert TRTLLM.kv_events_endpoint(p, replica()) == "http://127.0.0.1:8100/kv_cache_events"


def test_context_role() -> None:
    spec = TRTLLM.launch_spec(pool(engine="trtllm", roles={"prefill": 1}), replica(role=Role.PREFILL))
    assert spec.argv[spec.argv.index("--server_role") + 1] == "CONTEXT"


@pytest.mark.parametrize(
    ("fields", "problem"),
    [({"api_key": "k"}, "--api-key"), ({"lora_modules": {"a": "/a"}}, "lora"),
     ({"served_model_name": "x"}, "--served_model_name")],
    ids=["api-key", "lora", "served-name"],
)  # fmt: skip
def test_validate(fields: dict[str, Any], problem: str) -> None:
    assert any(problem in p for p in TRTLLM.validate(pool(engine="trtllm", **fields)))


@pytest.mark.parametrize(
    ("status", "headers", "probe"),
    [
        (None, {}, Probe.STARTING),
        (503, {"x-trtllm-server-state": "starting", "retry-after": "1"}, Probe.STARTING),
        (503, {"X-TRTLLM-Server-State": "Starting"}, Probe.STARTING),
        (503, {}, Probe.FAILING),
        (200, {}, Probe.READY),
    ],
    ids=["refused-old-builds", "starting-header", "header-case", "plain-503", "ready"],
)
def test_classify_health(status: int | None, headers: dict[str, str], probe: Probe) -> None:
    assert TRTLLM.classify_health(status, headers) is probe


def test_parse_prometheus_metrics() -> None:
    stats = TRTLLM.parse_metrics(fixture_text("trtllm_prometheus.txt"))
    assert stats == EndpointStats(
        running=6, waiting=2, kv_usage_ratio=0.4, prefix_cache_hits_tokens=100 * 32.0,
        prefix_cache_queries_tokens=400 * 32.0, preemptions=0.0, block_size=32, num_gpu_blocks=5000,
    )  # fmt: skip


def test_prometheus_utilization_from_block_counts_when_missing() -> None:
    text = "trtllm_num_requests_running 1\ntrtllm_kv_cache_max_blocks 100\ntrtllm_kv_cache_free_blocks 25\n"
    assert TRTLLM.parse_metrics(text).kv_usage_ratio == pytest.approx(0.75)


def test_parse_json_iteration_stats_uses_the_latest_iteration() -> None:
    stats = TRTLLM.parse_metrics(fixture_text("trtllm_iteration_stats.json"))
    assert stats == EndpointStats(
        running=9, waiting=3 + 1, kv_usage_ratio=1200 / 4000, prefix_cache_hits_tokens=60 * 32.0,
        prefix_cache_queries_tokens=240 * 32.0, block_size=32, num_gpu_blocks=4000,
    )  # fmt: skip


def test_json_iteration_stats_as_decoded_json() -> None:
    items = json.loads(fixture_text("trtllm_iteration_stats.json"))
    assert TRTLLM.parse_metrics(items).running == 9


def test_json_without_used_blocks_falls_back_to_alloc_total() -> None:
    item = {"numActiveRequests": 1, "kvCacheStats": {"maxNumBlocks": 10, "allocTotalBlocks": 4}}
    assert TRTLLM.parse_metrics([item]).kv_usage_ratio == pytest.approx(0.4)


def test_drained_empty_list_means_idle() -> None:
    previous = EndpointStats(running=5, waiting=2, kv_usage_ratio=0.3, block_size=32, num_gpu_blocks=9)
    stats = TRTLLM.parse_metrics("[]", previous)
    assert (stats.running, stats.waiting, stats.kv_usage_ratio, stats.num_gpu_blocks) == (0, 0, 0.3, 9)


@pytest.mark.parametrize("payload", ["hello 1\n", "{not json", 42], ids=["no-trtllm-names", "bad-json", "int"])
def test_unusable_payloads(payload: Any) -> None:
    with pytest.raises(MetricsFormatError):
        TRTLLM.parse_metrics(payload)


def test_shape_chat_strips_what_trtllm_rejects_and_maps_priority() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 64,
            "stream": False, "stream_options": {"include_usage": True}, "kv_transfer_params": {"x": 1},
            "vllm_xargs": {}, "cache_salt": "s", "return_token_ids": True, "priority": 2, "top_k": 5}  # fmt: skip
    assert TRTLLM.shape_request(body, "chat") == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": False,
        "priority": 1.0, "top_k": 5,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("priority", "expected"), [(-2, 0.0), (-1, 0.25), (0, 0.5), (1, 0.75), (2, 1.0), (9, 1.0)],
    ids=["sheddable", "low", "normal-is-trt-default", "high", "critical", "clamped"],
)  # fmt: skip
def test_priority_scale(priority: int, expected: float) -> None:
    assert TRTLLM.shape_request({"priority": priority}, "completions")["priority"] == expected


def test_priority_dropped_when_engine_queue_is_not_priority() -> None:
    shaped = TRTLLM.shape_request({"priority": 1}, "chat", pool(engine="trtllm", priority_scheduling=False))
    assert "priority" not in shaped


def test_stream_options_kept_when_streaming() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    assert TRTLLM.shape_request(body, "completions") == body


def test_pd_handshake() -> None:
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    first = TRTLLM.prefill_leg_body(body)
    assert first == {"model": "m", "messages": [], "stream": False,
                     "disaggregated_params": {"request_type": "context_only"}}  # fmt: skip
    response = {
        "choices": [{"index": 0, "disaggregated_params": {"request_type": "context_only", "ctx_request_id": 7,
                                                          "first_gen_tokens": [42], "encoded_opaque_state": "b"}}],
        "prompt_token_ids": [1, 2, 3],
    }  # fmt: skip
    second = TRTLLM.decode_leg_body(body, response)
    assert second == {**body, "prompt_token_ids": [1, 2, 3], "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": 7, "first_gen_tokens": [42],
        "encoded_opaque_state": "b"}}  # fmt: skip


def test_pd_handshake_without_params_is_an_error() -> None:
    with pytest.raises(PdHandshakeError, match="disaggregated_params"):
        TRTLLM.decode_leg_body({"model": "m"}, {"choices": [{"index": 0}]})

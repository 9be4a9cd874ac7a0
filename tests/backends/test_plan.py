"""Planning: replicas, ports and devices as they would be launched, and the printed plan."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest

from backends.config import BackendsSettings, PoolConfig
from backends.plan import plan_replicas, render_plan, replica_slots
from backends.types import PlanError, Role
from tests.backends.builders import pool


def no_tool(tool: str) -> tuple[int, ...] | None:
    return None


def settings(**fields: Any) -> BackendsSettings:
    return BackendsSettings.model_validate(fields)


def test_replica_slots_order() -> None:
    assert replica_slots(pool(replicas=2)) == [(Role.BOTH, 0), (Role.BOTH, 1)]
    assert replica_slots(pool(roles={"decode": 2, "prefill": 1})) == [
        (Role.PREFILL, 0), (Role.DECODE, 0), (Role.DECODE, 1)]  # fmt: skip
    surging = pool(engine="sim", autoscale={"max_replicas": 2, "surge_replicas": 1})
    assert replica_slots(surging) == [(Role.BOTH, 0), (Role.BOTH, 1), (Role.BOTH, 2)]  # a slot for the surge


def test_ports_devices_and_ids_are_deterministic() -> None:
    pools = [
        pool(name="a", engine="vllm", replicas=2, devices="auto", kv_events={"enabled": True}),
        pool(name="b", engine="vllm", roles={"prefill": 1, "decode": 1}, devices=[3, 2]),
        pool(name="c", engine="sim", replicas=1, port_base=9000),
        pool(name="remote", engine="openai", endpoints=[{"url": "https://api.example.com/v1"}]),
    ]
    planned = plan_replicas(pools, settings(devices=[0, 1, 2, 3], port_base=8100), detect=no_tool)
    rows = [(p.endpoint_id, p.replica.port, p.replica.devices, p.replica.kv_events_port,
             p.replica.kv_events_replay_port, p.replica.kv_transfer_port) for p in planned]  # fmt: skip
    assert rows == [
        ("a/both-0", 8100, (0,), 5557, 5657, None),
        ("a/both-1", 8101, (1,), 5558, 5658, None),
        ("b/prefill-0", 8102, (3,), None, None, 5600),
        ("b/decode-0", 8103, (2,), None, None, 5601),
        ("c/both-0", 9000, (), None, None, None),
    ]
    assert planned[0].replica.log_path == "var/log/engines/a.both-0.log"
    assert plan_replicas(pools, settings(devices=[0, 1, 2, 3]), detect=no_tool) == planned


def test_automatic_ports_avoid_explicit_ones_and_busy_ones() -> None:
    pools = [pool(name="a", replicas=2), pool(name="b", replicas=1, port_base=8101)]
    planned = plan_replicas(pools, settings(port_base=8100), port_is_free=lambda h, p: p != 8102)
    assert [p.replica.port for p in planned] == [8100, 8103, 8101]


def test_auto_devices_come_from_the_detected_tool() -> None:
    seen: list[str] = []

    def detect(tool: str) -> tuple[int, ...] | None:
        seen.append(tool)
        return (0, 1, 2, 3, 4, 5, 6, 7)

    planned = plan_replicas([pool(engine="vllm-ascend", devices="auto", tensor_parallel=8)], settings(), detect=detect)
    assert seen == ["npu-smi"]
    assert planned[0].replica.devices == tuple(range(8))
    assert planned[0].spec.env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


def test_pool_asking_for_more_devices_than_exist_is_a_config_error_naming_it() -> None:
    pools = [pool(name="llama-70b", engine="vllm", replicas=3, tensor_parallel=4, devices="auto")]
    with pytest.raises(PlanError, match=re.escape("pool 'llama-70b': needs 12 devices (3 replicas x 4 per replica")):
        plan_replicas(pools, settings(devices=list(range(8))))


def test_overlapping_explicit_devices_across_pools() -> None:
    pools = [pool(name="a", engine="vllm", devices=[0]), pool(name="b", engine="vllm", devices=[0])]
    with pytest.raises(PlanError, match="pool 'b': device 0 is already given to pool 'a'"):
        plan_replicas(pools, settings(devices=[0, 1]))


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ([pool(name="t", engine="trtllm", api_key="k")], "pool 't' (trtllm): trtllm-serve has no --api-key"),
        ([pool(name="a", port_base=9000), pool(name="b", port_base=9000)], "port 9000 is already used"),
        ([pool(name="a"), pool(name="a")], "pool 'a': two pools share this name"),
    ],
    ids=["adapter-refuses", "port-clash", "duplicate-name"],
)
def test_plan_errors(pools: list[PoolConfig], message: str) -> None:
    with pytest.raises(PlanError, match=re.escape(message)):
        plan_replicas(pools, settings())


def test_render_plan_is_exact_and_redacts_secrets() -> None:
    pools = [
        pool(name="l8", model="llama-3.1-8b", engine="vllm", engine_model="meta-llama/Llama-3.1-8B-Instruct",
             replicas=1, devices=[0], api_key="sk-live-123"),
        pool(name="t", engine="trtllm", replicas=1, devices=[1]),
        pool(name="remote", engine="openai", endpoints=[{"url": "https://api.openai.com/v1"}]),
        pool(name="s", engine="sim", replicas=1),
    ]  # fmt: skip
    text = render_plan(pools, settings(devices=[0, 1]), detect=no_tool)
    assert "sk-live-123" not in text
    assert "VLLM_API_KEY=<redacted>" in text
    command = next(line for line in text.splitlines() if "vllm serve" in line).strip()
    words = shlex.split(command)
    assert words[:2] == ["env", "CUDA_VISIBLE_DEVICES=0"]
    planned = plan_replicas(pools, settings(devices=[0, 1]), detect=no_tool)
    assert words[words.index("vllm") :] == list(planned[0].spec.argv)  # printed = launched
    assert "file var/run/engines/t.both-0.trtllm.yaml:" in text
    assert "enable_iter_perf_stats: true" in text
    assert "remote/both-s0: https://api.openai.com (static, not launched)" in text


def test_render_plan_notes_unmanaged_devices() -> None:
    text = render_plan([pool(name="g", engine="vllm")], settings(), detect=no_tool)
    assert "devices are not managed" in text


def test_a_simulated_pool_with_a_kv_store_gets_the_store_process_and_its_replicas_join_it() -> None:
    store = {"capacity_tokens": 200_000, "bandwidth_gbps": 5.0, "latency_ms": 2.0}
    pools = [
        pool(name="s", engine="sim", replicas=2, kv_store=store, preset="qwen2.5-7b@h100", block_size=32),
        pool(name="v", engine="vllm", replicas=1, kv_store=store),  # a real engine's store is deployed apart
    ]
    planned = plan_replicas(pools, settings(port_base=8100), detect=no_tool)
    s0, s1, v0 = planned
    assert s0.store is not None and s0.store is s1.store and v0.store is None
    assert s0.store.url == "http://127.0.0.1:8100"  # its own port, before the replicas'
    assert [s0.replica.port, s1.replica.port] == [8101, 8102]
    argv = list(s0.store.spec.argv)
    assert argv[1:4] == ["-m", "sim", "store"]
    assert shlex.join(argv[4:]) == (
        "--host 127.0.0.1 --port 8100 --capacity-tokens 200000 --bandwidth-gbps 5.0 --latency-ms 2.0 "
        "--preset qwen2.5-7b@h100 --block-size 32"
    )
    assert s0.store.spec.log_path == "var/log/engines/s.kv-store.log"
    for item in (s0, s1):
        assert shlex.join(item.spec.argv).endswith("--kv-store-url http://127.0.0.1:8100")
    assert "--kv-store-url" not in v0.spec.argv
    assert "s/kv-store: http://127.0.0.1:8100" in render_plan(pools, settings(port_base=8100), detect=no_tool)
    exposed = plan_replicas([pool(name="w", engine="sim", host="0.0.0.0", kv_store=store)], settings(), detect=no_tool)
    assert exposed[0].store is not None and exposed[0].store.spec.argv[4:6] == ("--host", "127.0.0.1")

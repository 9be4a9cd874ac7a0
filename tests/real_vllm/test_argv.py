"""Every command line the vLLM and vllm-ascend adapters can emit parses with vLLM's own `vllm serve`
argument parser and becomes a full engine config (no server starts): flags, JSON configs and their
field names are the real build's, not our reading of its source."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from backends.adapters.base import ReplicaPlan
from backends.adapters.vllm import VLLM, VLLM_ASCEND
from backends.config import PoolConfig
from backends.types import Role
from tests.real_vllm.conftest import VLLM_PYTHON, engine_env

HERE = Path(__file__).parent
PLUGIN_CONNECTORS = frozenset({"ascend-pd-mooncake"})


def _pool(model_dir: Path, **fields: Any) -> PoolConfig:
    return PoolConfig.model_validate({"name": "p", "model": "m", "engine": "vllm", "replicas": 1,
                                      "engine_model": str(model_dir), **fields})  # fmt: skip


def _replica(**fields: Any) -> ReplicaPlan:
    return ReplicaPlan(**{"pool": "p", "role": Role.BOTH, "index": 0, "host": "127.0.0.1", "port": 8100, **fields})


def cases(model_dir: Path) -> dict[str, tuple[PoolConfig, ReplicaPlan, Any]]:
    """One pool per adapter option, so every flag and JSON field the adapters write is exercised."""
    lora = model_dir.parent / "lora"
    return {
        "defaults": (_pool(model_dir), _replica(), VLLM),
        "every-option": (
            _pool(
                model_dir,
                served_model_name="served",
                max_model_len=1024,
                gpu_memory_utilization=0.5,
                block_size=32,
                enable_prefix_caching=False,
                max_num_seqs=4,
                max_num_batched_tokens=2048,
                priority_scheduling=False,
                api_key="sk-x",
                tokenizer=str(model_dir),
                extra_args=["--enforce-eager"],
            ),
            _replica(host="0.0.0.0", port=9000),
            VLLM,
        ),
        "kv-events-with-replay": (
            _pool(model_dir, kv_events={"enabled": True, "topic": "kv@p"}),
            _replica(kv_events_port=5557, kv_events_replay_port=5657, hash_seed="42"),
            VLLM,
        ),
        "lora": (_pool(model_dir, lora_modules={"sql": str(lora)}), _replica(), VLLM),
        "pd-prefill-nixl": (
            _pool(model_dir, roles={"prefill": 1, "decode": 1}, replicas=0),
            _replica(role=Role.PREFILL, kv_transfer_port=5600),
            VLLM,
        ),
        "pd-decode-other-connector": (
            _pool(
                model_dir,
                roles={"prefill": 1, "decode": 1},
                replicas=0,
                kv_transfer={"kv_connector": "LMCacheConnectorV1"},
            ),
            _replica(role=Role.DECODE, kv_transfer_port=5601),
            VLLM,
        ),
        "ascend-additional-config": (
            _pool(model_dir, engine="vllm-ascend", engine_config={"ascend_scheduler_config": {"enabled": True}}),
            _replica(),
            VLLM_ASCEND,
        ),
        "ascend-pd-mooncake": (
            _pool(model_dir, engine="vllm-ascend", roles={"prefill": 1, "decode": 1}, replicas=0),
            _replica(role=Role.PREFILL, kv_transfer_port=30000),
            VLLM_ASCEND,
        ),
    }


def parse(argvs: list[list[str]], build_config: list[bool]) -> list[dict[str, Any]]:
    request = json.dumps({"argvs": argvs, "build_config": build_config})
    done = subprocess.run(
        [str(VLLM_PYTHON), str(HERE / "parse_argv.py")],
        input=request,
        capture_output=True,
        text=True,
        env=engine_env(),
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    results: list[dict[str, Any]] = json.loads(lines[-1][len("RESULTS ") :])
    return results


def test_every_adapter_argv_parses_with_vllms_own_parser(model_dir: Path) -> None:
    (model_dir.parent / "lora").mkdir(exist_ok=True)
    table = cases(model_dir)
    argvs = [list(adapter.launch_spec(pool, replica).argv) for pool, replica, adapter in table.values()]
    # Mooncake connectors are registered by the vllm-ascend plugin, absent here: parsed, not built.
    builds = [name not in PLUGIN_CONNECTORS for name in table]
    results = dict(zip(table, parse(argvs, builds), strict=True))
    failed = {name: r["error"] for name, r in results.items() if not r["ok"]}
    assert not failed, failed
    every = results["every-option"]["args"]
    assert (every["block_size"], every["gpu_memory_utilization"], every["max_model_len"]) == (32, 0.5, 1024)
    assert every["enable_prompt_tokens_details"] is True and every["tokenizer"] == str(model_dir)
    assert results["defaults"]["args"]["block_size"] is None  # the engine chooses (128 on this CPU build)
    assert results["kv-events-with-replay"]["args"]["scheduling_policy"] == "priority"
    assert results["ascend-additional-config"]["args"]["additional_config"] == {
        "ascend_scheduler_config": {"enabled": True}
    }


def test_parser_rejects_what_the_old_defaults_wrote(model_dir: Path) -> None:
    """The parser really checks: a misspelt flag and a bad JSON config fail, as a launch would."""
    base = list(VLLM.launch_spec(_pool(model_dir), _replica()).argv)
    bad = [
        [*base, "--no-such-flag", "1"],
        [*base, "--kv-events-config", '{"enable_kv_cache_events": true, "no_such_field": 1}'],
    ]
    assert [r["ok"] for r in parse(bad, [True, True])] == [False, False]

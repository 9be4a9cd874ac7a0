"""vllm-ascend adapter: vLLM's protocol on NPUs (`vllm-project/vllm-ascend`)."""

from __future__ import annotations

import json

from backends.adapters.vllm import VLLM_ASCEND
from backends.types import Role
from tests.backends.builders import fixture_text, pool, replica


def test_launch_spec_golden_tp8_on_npus() -> None:
    p = pool(model="qwen", engine="vllm-ascend", engine_model="Qwen/Qwen2.5-72B-Instruct", tensor_parallel=8,
             max_model_len=32768, engine_config={"torchair_graph_config": {"enabled": True}})  # fmt: skip
    spec = VLLM_ASCEND.launch_spec(p, replica(devices=tuple(range(8))))
    assert list(spec.argv) == [
        "vllm", "serve", "Qwen/Qwen2.5-72B-Instruct", "--served-model-name", "qwen", "--host", "127.0.0.1",
        "--port", "8100", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "1",
        "--max-model-len", "32768", "--enable-prompt-tokens-details", "--enable-prefix-caching",
        "--scheduling-policy", "priority",
        "--additional-config", '{"torchair_graph_config":{"enabled":true}}',
    ]  # fmt: skip
    assert dict(spec.env) == {
        "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1",
    }  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES" not in spec.env


def test_block_size_is_left_to_the_engine() -> None:
    # refresh_block_size forces 128 with prefix caching (vllm_ascend/utils.py); the real size is read from the metrics
    spec = VLLM_ASCEND.launch_spec(pool(engine="vllm-ascend"), replica())
    assert "--block-size" not in spec.argv


def test_mooncake_pd_config_per_role() -> None:
    p = pool(engine="vllm-ascend", roles={"prefill": 1, "decode": 1}, tensor_parallel=2)
    prefill = VLLM_ASCEND.launch_spec(p, replica(role=Role.PREFILL, kv_transfer_port=30000))
    decode = VLLM_ASCEND.launch_spec(p, replica(role=Role.DECODE, kv_transfer_port=30001))

    def config(spec_argv: tuple[str, ...]) -> dict[str, object]:
        return json.loads(spec_argv[spec_argv.index("--kv-transfer-config") + 1])  # type: ignore[no-any-return]

    layout = {"dp_size": 1, "tp_size": 2}
    assert config(prefill.argv) == {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer",
                                    "kv_port": 30000, "kv_connector_extra_config": {"prefill": layout,
                                                                                   "decode": layout}}  # fmt: skip
    assert config(decode.argv)["kv_role"] == "kv_consumer"
    assert config(decode.argv)["kv_port"] == 30001


def test_prefill_leg_sets_min_tokens() -> None:
    leg = VLLM_ASCEND.prefill_leg_body({"model": "m", "min_tokens": 20, "max_tokens": 100})
    assert (leg["min_tokens"], leg["max_tokens"], leg["stream"]) == (1, 1, False)
    assert leg["kv_transfer_params"]["do_remote_decode"] is True


def test_metrics_parse_as_vllm() -> None:
    assert VLLM_ASCEND.parse_metrics(fixture_text("vllm_0_33_metrics.txt")).running == 12


def test_engine_config_allowed() -> None:
    assert VLLM_ASCEND.validate(pool(engine="vllm-ascend", engine_config={"a": 1})) == []

"""The simulated engine's adapter: vLLM's, launched as `python -m sim` with its preset."""

from __future__ import annotations

import sys

from backends.adapters.vllm import SIM, VLLM
from tests.backends.builders import fixture_text, pool, replica


def test_launch_spec_golden() -> None:
    p = pool(model="llama-3.1-8b", engine="sim", preset="llama-3.1-8b@h100", extra_args=["--time-scale", "10"])
    spec = SIM.launch_spec(p, replica())
    assert list(spec.argv) == [
        sys.executable, "-m", "sim", "serve", "llama-3.1-8b", "--served-model-name", "llama-3.1-8b",
        "--host", "127.0.0.1", "--port", "8100", "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
        "--block-size", "16", "--enable-prompt-tokens-details", "--enable-prefix-caching",
        "--scheduling-policy", "priority", "--preset", "llama-3.1-8b@h100", "--time-scale", "10",
    ]  # fmt: skip
    assert dict(spec.env) == {"PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1"}


def test_no_devices_needed_and_engine_bin_overrides() -> None:
    assert not SIM.uses_devices
    spec = SIM.launch_spec(pool(engine="sim", engine_bin=["/opt/sim"]), replica())
    assert spec.argv[:3] == ("/opt/sim", "serve", "m")


def test_same_protocol_as_vllm() -> None:
    text = fixture_text("vllm_0_33_metrics.txt")
    assert SIM.parse_metrics(text) == VLLM.parse_metrics(text)
    assert SIM.shape_request({"priority": 1}, "chat") == {"priority": -1}

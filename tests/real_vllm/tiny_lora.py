"""A random-weight LoRA adapter for the tiny model (tiny_model.py), written at test time: nothing is downloaded.

The directory is what PEFT saves and vLLM's runtime adapter API loads (`POST /v1/load_lora_adapter`):
`adapter_config.json` (PEFT's LoRA fields: rank, alpha, target modules) and `adapter_model.safetensors`
with one `lora_A` (rank x in) and one `lora_B` (out x rank) per targeted linear layer, named
`base_model.model.model.layers.N.<block>.<proj>` as PEFT prefixes a Llama's modules. The tensors are
written with torch and safetensors from the vLLM venv (the test's own interpreter need not have torch):
this module runs there as a script, `python tiny_lora.py MODEL_DIR OUT_DIR`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RANK = 8
# Every projection of a Llama decoder layer: vLLM maps q/k/v into its fused qkv_proj and gate/up into
# gate_up_proj, so both the fused and the plain layers are exercised.
TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def shapes(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each targeted projection, from the model's config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _write(model_dir: Path, out: Path) -> None:  # runs in the vLLM venv (torch, safetensors)
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    sizes = shapes(config)
    generator = torch.Generator().manual_seed(43)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, projections in TARGETS.items():
            for projection in projections:
                fan_in, fan_out = sizes[projection]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{projection}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=generator) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=generator) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors")
    )
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(p for projections in TARGETS.values() for p in projections),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


def build(python: Path, model_dir: Path, out: Path) -> Path:
    """Write the adapter for `model_dir` into `out` with the interpreter `python` (the vLLM venv's)."""
    subprocess.run([str(python), __file__, str(model_dir), str(out)], check=True, timeout=300)
    return out


if __name__ == "__main__":
    _write(Path(sys.argv[1]), Path(sys.argv[2]))
    print(sys.argv[2])

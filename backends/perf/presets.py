"""Model shapes, and presets: a model on a hardware, what a simulated engine "is".

A preset name composes a model and a hardware: ``MODEL[-tpN]@HW``, e.g. ``llama-3.1-8b@h100`` or
``llama-3.1-70b-tp4@h100``. Shapes come from each model's Hugging Face ``config.json``; the
hardware, its datasheet and its fitted serving efficiency are `hardware.py`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final

from backends.perf.hardware import HARDWARE, Efficiency, HardwareSpec


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Transformer shape. Parameter counts are derived from it, not typed in, so they cannot drift.

    `gated_ffn` is True for SwiGLU MLPs (Llama, Qwen: three matrices), False for the classic two-matrix
    MLP (OPT, BLOOM). `tied_embeddings` means the LM head reuses the embedding matrix (its FLOPs still
    count; its bytes are read once).
    """

    name: str
    hf_id: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    gated_ffn: bool = True
    tied_embeddings: bool = False
    dtype_bytes: int = 2  # bf16/fp16 weights and KV cache
    source: str = ""

    @property
    def attention_params_per_layer(self) -> int:
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_and_o + k_and_v

    @property
    def mlp_params_per_layer(self) -> int:
        matrices = 3 if self.gated_ffn else 2
        return matrices * self.hidden_size * self.intermediate_size

    @property
    def layer_params(self) -> int:
        """Matmul parameters of all decoder layers (norms and biases are negligible)."""
        return self.num_layers * (self.attention_params_per_layer + self.mlp_params_per_layer)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        heads = 1 if self.tied_embeddings else 2
        return self.layer_params + heads * self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Preset:
    """A model served on `tp` devices of one hardware kind: everything the performance model needs."""

    name: str
    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    efficiency: Efficiency = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "efficiency", self.hardware.efficiency)

    def with_efficiency(self, efficiency: Efficiency) -> Preset:
        """A copy with other factors (the calibration fit explores with it)."""
        hardware = replace(self.hardware, efficiency=efficiency)
        return Preset(self.name, self.model, hardware, self.tp)


# --- models -------------------------------------------------------------------------------------

_MODELS: dict[str, ModelSpec] = {}


def _model(spec: ModelSpec) -> None:
    _MODELS[spec.name] = spec


# https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (8.03B parameters)
_model(
    ModelSpec(
        "llama-3.1-8b",
        "meta-llama/Llama-3.1-8B",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_model_len=131072,
        source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
    )
)
# https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json (70.6B parameters)
_model(
    ModelSpec(
        "llama-3.1-70b",
        "meta-llama/Llama-3.1-70B",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        max_model_len=131072,
        source="https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json",
    )
)
# https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json (69.0B parameters)
_model(
    ModelSpec(
        "llama-2-70b",
        "meta-llama/Llama-2-70b-hf",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=32000,
        max_model_len=4096,
        source="https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json",
    )
)
# https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json (7.61B parameters)
_model(
    ModelSpec(
        "qwen2.5-7b",
        "Qwen/Qwen2.5-7B-Instruct",
        num_layers=28,
        hidden_size=3584,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
        max_model_len=32768,
        source="https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json",
    )
)
# The Qwen3 dense models exist because public vLLM benchmarks measured them (bench/sim_calibration).
# https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json (8.19B parameters)
_model(
    ModelSpec(
        "qwen3-8b",
        "Qwen/Qwen3-8B",
        num_layers=36,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        max_model_len=40960,
        source="https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
    )
)
# https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json (14.8B parameters)
_model(
    ModelSpec(
        "qwen3-14b",
        "Qwen/Qwen3-14B",
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=17408,
        vocab_size=151936,
        max_model_len=40960,
        source="https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json",
    )
)
# The next three exist because the calibration data measured them (splitwise_sim, DistServe).
# https://huggingface.co/bigscience/bloom/blob/main/config.json (176B; MHA, 4h GELU MLP, tied head)
_model(
    ModelSpec(
        "bloom-176b",
        "bigscience/bloom",
        num_layers=70,
        hidden_size=14336,
        num_heads=112,
        num_kv_heads=112,
        head_dim=128,
        intermediate_size=4 * 14336,
        vocab_size=250880,
        max_model_len=2048,
        gated_ffn=False,
        tied_embeddings=True,
        source="https://huggingface.co/bigscience/bloom/blob/main/config.json",
    )
)
# https://huggingface.co/facebook/opt-13b/blob/main/config.json (12.9B; ReLU MLP, tied head)
_model(
    ModelSpec(
        "opt-13b",
        "facebook/opt-13b",
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        intermediate_size=20480,
        vocab_size=50272,
        max_model_len=2048,
        gated_ffn=False,
        tied_embeddings=True,
        source="https://huggingface.co/facebook/opt-13b/blob/main/config.json",
    )
)
# https://huggingface.co/facebook/opt-66b/blob/main/config.json (65.7B; ReLU MLP, tied head)
_model(
    ModelSpec(
        "opt-66b",
        "facebook/opt-66b",
        num_layers=64,
        hidden_size=9216,
        num_heads=72,
        num_kv_heads=72,
        head_dim=128,
        intermediate_size=36864,
        vocab_size=50272,
        max_model_len=2048,
        gated_ffn=False,
        tied_embeddings=True,
        source="https://huggingface.co/facebook/opt-66b/blob/main/config.json",
    )
)

MODELS: Final = MappingProxyType(_MODELS)

DEFAULT_PRESET: Final = "llama-3.1-8b@h100"
_PRESET_RE: Final = re.compile(r"^(?P<model>[a-z0-9.\-]+?)(?:-tp(?P<tp>\d+))?@(?P<hw>[a-z0-9.\-]+)$")


class UnknownPresetError(ValueError):
    """The preset name does not parse or names an unknown model or hardware."""


def resolve_preset(name: str, tp: int | None = None) -> Preset:
    """`"llama-3.1-70b-tp4@h100"` → Preset(model, hardware, tp=4).

    `tp` (e.g. from ``-tp``) overrides a missing ``-tpN`` suffix; a suffix and a different explicit
    `tp` is an error, since one of them is a typo.
    """
    match = _PRESET_RE.match(name.strip().lower())
    if match is None:
        raise UnknownPresetError(f"preset {name!r} is not MODEL[-tpN]@HARDWARE")
    model = MODELS.get(match["model"])
    hardware = HARDWARE.get(match["hw"])
    if model is None:
        raise UnknownPresetError(f"unknown model {match['model']!r}; known: {', '.join(sorted(MODELS))}")
    if hardware is None:
        raise UnknownPresetError(f"unknown hardware {match['hw']!r}; known: {', '.join(sorted(HARDWARE))}")
    suffix_tp = int(match["tp"]) if match["tp"] else None
    if suffix_tp is not None and tp is not None and tp != suffix_tp and tp != 1:
        raise UnknownPresetError(f"preset {name!r} says tp={suffix_tp} but tp={tp} was given")
    resolved_tp = suffix_tp or tp or 1
    if resolved_tp < 1 or model.num_heads % resolved_tp:
        raise UnknownPresetError(f"tp={resolved_tp} does not divide the {model.num_heads} attention heads")
    canonical = f"{model.name}{f'-tp{resolved_tp}' if resolved_tp > 1 else ''}@{hardware.name}"
    return Preset(canonical, model, hardware, resolved_tp)


def is_preset_name(name: str) -> bool:
    """Whether `name` parses as a known preset (the CLI's positional MODEL may be one, or a model id)."""
    try:
        resolve_preset(name)
    except UnknownPresetError:
        return False
    return True


def preset_names() -> list[str]:
    """Every MODEL@HW combination (TP variants are open-ended and not listed)."""
    return [f"{m}@{h}" for m in sorted(MODELS) for h in sorted(HARDWARE)]

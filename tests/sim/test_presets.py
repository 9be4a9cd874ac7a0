from __future__ import annotations

import pytest

from backends.perf.hardware import HARDWARE
from backends.perf.presets import MODELS, UnknownPresetError, is_preset_name, resolve_preset


@pytest.mark.parametrize(
    ("model", "published_params"),
    [
        ("llama-3.1-8b", 8.03e9),
        ("llama-3.1-70b", 70.6e9),
        ("llama-2-70b", 69.0e9),
        ("qwen2.5-7b", 7.61e9),
        ("bloom-176b", 176.2e9),
        ("opt-13b", 12.9e9),
    ],
    ids=lambda v: str(v),
)
def test_parameter_count_derived_from_shape_matches_the_model_card(model: str, published_params: float) -> None:
    assert MODELS[model].total_params == pytest.approx(published_params, rel=0.02)


@pytest.mark.parametrize(
    ("name", "canonical", "tp"),
    [
        ("llama-3.1-8b@h100", "llama-3.1-8b@h100", 1),
        ("llama-3.1-70b-tp4@h100", "llama-3.1-70b-tp4@h100", 4),
        ("Qwen2.5-7B@Ascend-910B", "qwen2.5-7b@ascend-910b", 1),
    ],
    ids=["plain", "tp-suffix", "case-insensitive"],
)
def test_preset_names_resolve(name: str, canonical: str, tp: int) -> None:
    preset = resolve_preset(name)
    assert (preset.name, preset.tp) == (canonical, tp)


def test_tp_flag_applies_when_the_name_has_no_suffix() -> None:
    assert resolve_preset("llama-3.1-70b@h200", tp=8).name == "llama-3.1-70b-tp8@h200"


@pytest.mark.parametrize(
    "name",
    ["llama-3.1-8b", "gpt-9@h100", "llama-3.1-8b@tpu", "llama-3.1-8b-tp5@h100"],
    ids=["no-hardware", "unknown-model", "unknown-hardware", "tp-not-dividing-heads"],
)
def test_bad_preset_names_are_rejected(name: str) -> None:
    with pytest.raises(UnknownPresetError):
        resolve_preset(name)
    assert not is_preset_name(name)


def test_required_models_and_hardware_exist_with_sources() -> None:
    for model in ("llama-3.1-8b", "llama-3.1-70b", "llama-2-70b", "qwen2.5-7b"):
        assert MODELS[model].source.startswith("https://")
    for hw in ("a100", "h100", "h200", "h20", "ascend-910b"):
        spec = HARDWARE[hw]
        assert spec.source.startswith("https://")
        assert spec.peak_flops > 1e14 and spec.hbm_bandwidth > 1e12 and spec.hbm_capacity > 32 * 2**30

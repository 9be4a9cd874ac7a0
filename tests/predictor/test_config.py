from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from predictor.config import PredictorSettings

GATEWAY_YAML_SECTION = """
enabled: true
model_dir: var/predictor
min_samples: 500
retrain_interval_s: 10
worker: thread
length:
  default_output_tokens: 512
advanced:
  buffer:
    capacity: 5000
    waiting_edges: [1, 4, 16]
  xgboost:
    n_trees: 40
    max_depth: 4
"""


def test_defaults_are_valid_and_use_a_training_process() -> None:
    settings = PredictorSettings()
    assert settings.enabled and settings.online_training
    assert settings.worker == "process"
    assert settings.model_dir is None
    assert settings.advanced.xgboost.max_depth <= 8


def test_gateway_yaml_section() -> None:
    settings = PredictorSettings.model_validate(yaml.safe_load(GATEWAY_YAML_SECTION))
    assert str(settings.model_dir) == "var/predictor"
    assert settings.advanced.buffer.waiting_edges == (1, 4, 16)
    assert settings.advanced.buffer.capacity == 5000
    assert (settings.advanced.xgboost.n_trees, settings.advanced.xgboost.max_depth) == (40, 4)
    assert settings.length.default_output_tokens == 512


@pytest.mark.parametrize(
    "section",
    [
        {"worker": "gpu"},
        {"unknown_key": 1},
        {"advanced": {"buffer": {"waiting_edges": [3, 1]}}},
        {"advanced": {"buffer": {"waiting_edges": [0, 1]}}},
        {"advanced": {"buffer": {"heldout_fraction": 0.7}}},
        {"advanced": {"xgboost": {"max_depth": 12}}},
        {"xgboost": {"n_trees": 40}},
        {"prior": {"ttft_p90_factor": 0.5}},
    ],
    ids=["worker", "unknown-key", "edges-order", "edges-zero", "heldout", "depth", "old-place", "p90-factor"],
)
def test_invalid_settings_are_rejected(section: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        PredictorSettings.model_validate(section)

from __future__ import annotations

import numpy as np
import pytest
import xgboost as xgb

from predictor.model import CompiledForest


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 6)).astype(np.float32)
    x[:, 2] = rng.integers(0, 4, n)  # a discrete column: thresholds fall between integers
    y = 3 * x[:, 0] + np.sin(6 * x[:, 1]) + x[:, 2] + rng.normal(0, 0.1, n)
    return x, y


def _train(objective: dict[str, object], depth: int, rounds: int, x: np.ndarray, y: np.ndarray) -> xgb.Booster:
    params = {"tree_method": "hist", "max_depth": depth, "nthread": 1, "seed": 0} | objective
    return xgb.train(params, xgb.DMatrix(x, label=y), rounds)


def test_compiled_forest_equals_xgboost_predictions() -> None:
    x, y = _data(2000, 0)
    boosters = [
        _train({"objective": "reg:squarederror"}, 3, 40, x, y),
        _train({"objective": "reg:quantileerror", "quantile_alpha": 0.9}, 6, 30, x, y),
        # min_child_weight stops some branches early: leaves at several depths
        _train({"objective": "reg:squarederror", "min_child_weight": 200}, 5, 20, x, y),
    ]
    forest = CompiledForest.compile([bytes(b.save_raw("json")) for b in boosters])
    assert forest.num_outputs == 3 and forest.num_trees == 90 and forest.depth == 6
    test_x, _ = _data(500, 1)
    expected = np.stack([b.inplace_predict(test_x) for b in boosters], axis=1)
    np.testing.assert_allclose(forest.predict(test_x), expected, rtol=1e-5, atol=1e-5)


def test_constant_model_and_single_row() -> None:
    x, _ = _data(100, 2)
    booster = _train({"objective": "reg:squarederror"}, 4, 5, x, np.full(100, 7.0))
    forest = CompiledForest.compile([bytes(booster.save_raw("json"))])
    out = forest.predict(x[:1])
    assert out.shape == (1, 1)
    assert out[0, 0] == pytest.approx(float(booster.inplace_predict(x[:1])[0]), abs=1e-5)


def test_rejects_multi_output_models() -> None:
    x, y = _data(200, 3)
    booster = xgb.train(
        {"objective": "reg:quantileerror", "quantile_alpha": [0.5, 0.9], "nthread": 1},
        xgb.DMatrix(x, label=y),
        2,
    )
    with pytest.raises(ValueError, match="single-output"):
        CompiledForest.compile([bytes(booster.save_raw("json"))])

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from predictor.config import XGBoostSettings
from predictor.features import FloatArray, Target
from predictor.model import PoolModel, TargetModel, train_target
from predictor.persist import ModelStore
from tests.predictor.synthetic import POOL, samples

PRIOR_ID = "llama-3.1-8b@h100|v1|seqs=256|tokens=8192"


Factory = tuple[dict[Target, TargetModel], FloatArray]


@pytest.fixture(scope="module")
def model_factory() -> Factory:
    rng = np.random.default_rng(5)
    train, heldout = samples(800, rng), samples(200, rng)
    targets: dict[Target, TargetModel] = {}
    for target in Target:
        model = train_target(train, heldout, target, XGBoostSettings(n_trees=20), 100, True)
        assert model is not None
        targets[target] = model
    return targets, heldout.rows[:16]


def _model(factory: Factory, version: int) -> PoolModel:
    return PoolModel.assemble(version, factory[0])


@pytest.mark.slow
def test_round_trip_predicts_identically(tmp_path: Path, model_factory: Factory) -> None:
    store = ModelStore(tmp_path)
    model = _model(model_factory, 4)
    folder = store.save(POOL, model, PRIOR_ID)
    assert folder == tmp_path / POOL / "v000004"
    assert json.loads((folder / "meta.json").read_text())["prior"] == PRIOR_ID
    loaded = store.load(POOL, PRIOR_ID)
    assert loaded is not None and loaded.version == 4
    rows = model_factory[1]
    np.testing.assert_array_equal(loaded.latency_ms(rows), model.latency_ms(rows))
    for target in Target:
        assert loaded.targets[target].trained_at_s == model.targets[target].trained_at_s
        assert loaded.targets[target].heldout == model.targets[target].heldout
        assert loaded.targets[target].p90_floor == model.targets[target].p90_floor != 0.0


def test_keeps_the_newest_versions(tmp_path: Path, model_factory: Factory) -> None:
    store = ModelStore(tmp_path, keep_versions=2)
    for version in range(1, 5):
        store.save(POOL, _model(model_factory, version), PRIOR_ID)
    assert store.versions(POOL) == [4, 3]
    assert store.latest_version(POOL) == 4
    assert not [p for p in (tmp_path / POOL).iterdir() if p.name.startswith(".")]


def test_a_model_of_another_prior_or_layout_is_not_loaded(tmp_path: Path, model_factory: Factory) -> None:
    store = ModelStore(tmp_path)
    folder = store.save(POOL, _model(model_factory, 1), PRIOR_ID)
    assert store.load(POOL, "llama-3.1-70b@h100|v1|seqs=256|tokens=8192") is None
    meta = json.loads((folder / "meta.json").read_text())
    meta["feature_names"] = meta["feature_names"][:-1]
    (folder / "meta.json").write_text(json.dumps(meta))
    assert store.load(POOL, PRIOR_ID) is None
    assert store.load("never-trained", PRIOR_ID) is None


def test_a_model_saved_before_p90_floors_loads_with_none(tmp_path: Path, model_factory: Factory) -> None:
    store = ModelStore(tmp_path)
    folder = store.save(POOL, _model(model_factory, 1), PRIOR_ID)
    meta = json.loads((folder / "meta.json").read_text())
    for info in meta["targets"].values():
        del info["p90_floor"]
    (folder / "meta.json").write_text(json.dumps(meta))
    loaded = store.load(POOL, PRIOR_ID)
    assert loaded is not None and all(m.p90_floor == 0.0 for m in loaded.targets.values())


def test_a_damaged_newest_version_falls_back_to_an_older_one(tmp_path: Path, model_factory: Factory) -> None:
    store = ModelStore(tmp_path)
    store.save(POOL, _model(model_factory, 1), PRIOR_ID)
    newest = store.save(POOL, _model(model_factory, 2), PRIOR_ID)
    (newest / "ttft_mean.json").write_text("{not json")
    loaded = store.load(POOL, PRIOR_ID)
    assert loaded is not None and loaded.version == 1


def test_samples_round_trip_and_are_refused_for_another_layout_or_when_damaged(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    assert store.load_samples(POOL, PRIOR_ID) is None  # none saved yet
    rng = np.random.default_rng(6)
    train, heldout = samples(50, rng), samples(10, rng)
    train.tpot_ms[::4] = np.nan  # single-token completions have no TPOT
    path = store.save_samples(POOL, train, heldout, PRIOR_ID)
    assert path.name == "samples.npz" and not [p for p in path.parent.iterdir() if p.name.startswith(".")]
    loaded = store.load_samples(POOL, PRIOR_ID)
    assert loaded is not None
    for saved, got in zip((train, heldout), loaded, strict=True):
        np.testing.assert_array_equal(got.rows, saved.rows)
        np.testing.assert_array_equal(got.ttft_ms, saved.ttft_ms)
        np.testing.assert_array_equal(got.tpot_ms, saved.tpot_ms)  # NaN where NaN
    assert store.load_samples(POOL, PRIOR_ID + "|x0.5") is None  # rows against another prior mean something else

    path.write_bytes(b"not a numpy archive")
    assert store.load_samples(POOL, PRIOR_ID) is None

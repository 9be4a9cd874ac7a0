"""Saving pool models to a directory and loading the newest usable one at start.

Layout, one folder per pool and version (pool names are validated to be path-safe):

    <model_dir>/<pool>/v000007/meta.json          format, feature layout, prior, per-target metadata
    <model_dir>/<pool>/v000007/ttft_mean.json     XGBoost JSON models, one per (target, quantity)
    ...
    <model_dir>/<pool>/samples.npz                the pool's training and held-out samples

Samples are saved with every model and when the gateway stops, and put back into the buffers at
start: a restarted gateway keeps training on everything it learnt from, instead of retraining its
next model on the few hundred samples of its first minutes (which, on the predictor benchmark, made
the online TPOT MAPE of a restarted gateway at 90 % load 31 % where one that kept its samples had 21 %).

A version is written to a temporary folder and renamed into place, so a reader (or a crash) never
sees half a model. The newest `keep_versions` are kept. A saved model is only loaded when it was
trained on the same feature layout and the same prior (preset and formula version): its trees
predict a correction to that prior and would be wrong over any other.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from predictor.features import FEATURE_NAMES, FEATURES_VERSION, AccuracyScore, Quantity, Samples, Target
from predictor.model import PoolModel, TargetModel

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_META = "meta.json"
_SAMPLES = "samples.npz"
_SAMPLE_PARTS = ("rows", "ttft_ms", "tpot_ms")


class ModelStore:
    def __init__(self, directory: Path, keep_versions: int = 3) -> None:
        self.directory = directory
        self.keep_versions = keep_versions

    def _pool_dir(self, pool: str) -> Path:
        return self.directory / pool

    def versions(self, pool: str) -> list[int]:
        """Saved versions of a pool, newest first."""
        folder = self._pool_dir(pool)
        if not folder.is_dir():
            return []
        found = [
            int(entry.name[1:])
            for entry in folder.iterdir()
            if entry.name.startswith("v") and entry.name[1:].isdigit() and (entry / _META).is_file()
        ]
        return sorted(found, reverse=True)

    def save(self, pool: str, model: PoolModel, prior_id: str) -> Path:
        """Write one version atomically; blocking file I/O, so call it off the event loop."""
        folder = self._pool_dir(pool)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"v{model.version:06d}"
        tmp = folder / f".v{model.version:06d}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        targets: dict[str, Any] = {}
        for target, tm in model.targets.items():
            for quantity, blob in ((Quantity.MEAN, tm.mean_json), (Quantity.P90, tm.p90_json)):
                (tmp / f"{target}_{quantity}.json").write_bytes(blob)
            targets[target.value] = {
                "p90_offset": tm.p90_offset,
                "p90_floor": tm.p90_floor,
                "trained_at_s": tm.trained_at_s,
                "train_samples": tm.train_samples,
                "heldout": _score_out(tm.heldout),
                "prior_heldout": _score_out(tm.prior_heldout),
            }
        meta = {
            "format": FORMAT_VERSION,
            "features_version": FEATURES_VERSION,
            "feature_names": list(FEATURE_NAMES),
            "prior": prior_id,
            "pool": pool,
            "version": model.version,
            "targets": targets,
        }
        (tmp / _META).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in self.versions(pool)[self.keep_versions :]:
            shutil.rmtree(folder / f"v{old:06d}", ignore_errors=True)
        return final

    def save_samples(self, pool: str, train: Samples, heldout: Samples, prior_id: str) -> Path:
        """Write the pool's samples atomically (a temporary file renamed over the old one); blocking."""
        folder = self._pool_dir(pool)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / _SAMPLES
        tmp = folder / f".{_SAMPLES}.tmp-{os.getpid()}"
        arrays: dict[str, Any] = {"layout": np.array(json.dumps(_sample_layout(prior_id)))}
        for prefix, samples in (("train", train), ("heldout", heldout)):
            for part in _SAMPLE_PARTS:
                arrays[f"{prefix}_{part}"] = getattr(samples, part)
        with tmp.open("wb") as out:
            np.savez(out, **arrays)
        os.replace(tmp, final)
        return final

    def load_samples(self, pool: str, prior_id: str) -> tuple[Samples, Samples] | None:
        """The saved (training, held-out) samples, or None when absent, unreadable, or taken with
        another feature layout or prior (their rows would not mean the same)."""
        path = self._pool_dir(pool) / _SAMPLES
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                layout = json.loads(str(data["layout"]))
                if layout != _sample_layout(prior_id):
                    log.info("predictor: %s was taken with another feature layout or prior", path)
                    return None
                found = tuple(
                    Samples(*(np.asarray(data[f"{prefix}_{part}"]) for part in _SAMPLE_PARTS))
                    for prefix in ("train", "heldout")
                )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("predictor: skipping saved samples %s: %s", path, exc)
            return None
        for samples in found:
            n = len(samples.rows)
            if (
                samples.rows.ndim != 2
                or samples.rows.shape[1] != len(FEATURE_NAMES)
                or any(len(getattr(samples, part)) != n for part in _SAMPLE_PARTS)
            ):
                log.warning("predictor: skipping saved samples %s: inconsistent shapes", path)
                return None
        return found[0], found[1]

    def load(self, pool: str, prior_id: str) -> PoolModel | None:
        """The newest saved version usable with this prior, or None."""
        for version in self.versions(pool):
            folder = self._pool_dir(pool) / f"v{version:06d}"
            try:
                model = _load_version(folder, prior_id)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("predictor: skipping saved model %s: %s", folder, exc)
                continue
            if model is not None:
                return model
        return None

    def latest_version(self, pool: str) -> int:
        versions = self.versions(pool)
        return versions[0] if versions else 0


def _sample_layout(prior_id: str) -> dict[str, Any]:
    """What saved samples' rows mean: stored with them, compared when they are loaded."""
    return {"features_version": FEATURES_VERSION, "feature_names": list(FEATURE_NAMES), "prior": prior_id}


def _load_version(folder: Path, prior_id: str) -> PoolModel | None:
    meta = json.loads((folder / _META).read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT_VERSION:
        log.info("predictor: %s has format %s, want %s", folder, meta.get("format"), FORMAT_VERSION)
        return None
    if meta.get("features_version") != FEATURES_VERSION or meta.get("feature_names") != list(FEATURE_NAMES):
        log.info("predictor: %s was trained on another feature layout", folder)
        return None
    if meta.get("prior") != prior_id:
        log.info("predictor: %s was trained over prior %s, now %s", folder, meta.get("prior"), prior_id)
        return None
    targets: dict[Target, TargetModel] = {}
    for name, info in meta["targets"].items():
        target = Target(name)
        targets[target] = TargetModel(
            target=target,
            mean_json=(folder / f"{target}_{Quantity.MEAN}.json").read_bytes(),
            p90_json=(folder / f"{target}_{Quantity.P90}.json").read_bytes(),
            p90_offset=float(info["p90_offset"]),
            trained_at_s=float(info["trained_at_s"]),
            train_samples=int(info["train_samples"]),
            heldout=_score_in(info.get("heldout")),
            prior_heldout=_score_in(info.get("prior_heldout")),
            p90_floor=float(info.get("p90_floor", 0.0)),  # saved before floors: the p90 is at least the mean
        )
    if not targets:
        return None
    return PoolModel.assemble(int(meta["version"]), targets)


def _score_out(score: AccuracyScore | None) -> dict[str, Any] | None:
    if score is None:
        return None
    return {"samples": score.samples, "mape_pct": score.mape_pct, "p90_coverage": score.p90_coverage}


def _score_in(raw: dict[str, Any] | None) -> AccuracyScore | None:
    if raw is None:
        return None
    return AccuracyScore(int(raw["samples"]), float(raw["mape_pct"]), float(raw["p90_coverage"]))

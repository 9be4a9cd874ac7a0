"""Prediction accuracy: the error math, and an online tracker over recent requests.

Online accuracy is honest by construction: it scores the prediction made at routing time, before
the request ran, against what the request then did. MAPE is the mean of |predicted - actual| /
actual over the window (in percent); p90 coverage is the share of requests whose actual value was at
or below the predicted p90 (a calibrated p90 covers 90 %).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from predictor.types import PredictionSource

ArrayLike = npt.ArrayLike


def absolute_percentage_errors(predicted: ArrayLike, actual: ArrayLike) -> npt.NDArray[np.float64]:
    """|predicted - actual| / actual per sample (a ratio; 0.1 = 10 %). Actuals must be > 0."""
    pred = np.asarray(predicted, dtype=np.float64)
    act = np.asarray(actual, dtype=np.float64)
    return np.abs(pred - act) / act


def mape_pct(predicted: ArrayLike, actual: ArrayLike) -> float:
    """Mean absolute percentage error in percent; NaN for no samples."""
    errors = absolute_percentage_errors(predicted, actual)
    return float(errors.mean() * 100.0) if errors.size else float("nan")


def p90_coverage(predicted_p90: ArrayLike, actual: ArrayLike) -> float:
    """Share (0..1) of samples at or below their predicted p90; NaN for no samples."""
    p90 = np.asarray(predicted_p90, dtype=np.float64)
    act = np.asarray(actual, dtype=np.float64)
    return float((act <= p90).mean()) if act.size else float("nan")


@dataclass(frozen=True, slots=True)
class AccuracyScore:
    samples: int
    mape_pct: float
    p90_coverage: float

    @classmethod
    def of(cls, predicted: ArrayLike, predicted_p90: ArrayLike, actual: ArrayLike) -> AccuracyScore:
        act = np.asarray(actual, dtype=np.float64)
        return cls(int(act.size), mape_pct(predicted, act), p90_coverage(predicted_p90, act))

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "samples": self.samples,
            "mape_pct": _finite_or_none(self.mape_pct),
            "p90_coverage": _finite_or_none(self.p90_coverage),
        }


class OnlineAccuracy:
    """Rolling accuracy of one (pool, target) over the last `window` predicted requests.

    `record` is O(1) (two writes into preallocated rings); `score` summarises on demand.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._ape = np.zeros(window)
        self._covered = np.zeros(window, dtype=bool)
        self._from_model = np.zeros(window, dtype=bool)
        self._next = 0
        self._held = 0
        self.total = 0  # predictions ever scored

    def record(self, predicted_ms: float, predicted_p90_ms: float, actual_ms: float, source: PredictionSource) -> None:
        if not actual_ms > 0:  # a zero or NaN observation has no percentage error
            return
        slot = self._next
        self._ape[slot] = abs(predicted_ms - actual_ms) / actual_ms
        self._covered[slot] = actual_ms <= predicted_p90_ms
        self._from_model[slot] = source == "model"
        self._next = (slot + 1) % self.window
        self._held = min(self._held + 1, self.window)
        self.total += 1

    def score(self, source: PredictionSource | None = None) -> AccuracyScore:
        """Over the window; `source` restricts it to predictions made by the prior or a model."""
        held = slice(0, self._held)
        ape, covered = self._ape[held], self._covered[held]
        if source is not None:
            chosen = self._from_model[held] if source == "model" else ~self._from_model[held]
            ape, covered = ape[chosen], covered[chosen]
        if not ape.size:
            return AccuracyScore(0, float("nan"), float("nan"))
        return AccuracyScore(int(ape.size), float(ape.mean() * 100.0), float(covered.mean()))


def _finite_or_none(value: float) -> float | None:
    return round(value, 4) if np.isfinite(value) else None

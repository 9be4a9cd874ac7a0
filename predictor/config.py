"""The `predictor:` section of gateway.yaml.

Defaults are sized for one gateway process: 20,000 training samples per pool, four regressors of 50
depth-5 trees (predict() for eight candidates costs ~130 us with a model, ~45 us on the prior),
retraining in a separate process every few seconds once 200 new samples have arrived.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BufferSettings(_Strict):
    """Training samples per pool, stratified by load regime (see features.py)."""

    capacity: int = Field(default=20_000, ge=1, description="training samples kept, shared by all strata")
    waiting_edges: tuple[int, ...] = Field(
        default=(1, 3, 6, 11), description="engine queue bucket lower edges: 0 | 1-2 | 3-5 | 6-10 | 11+"
    )
    kv_buckets: int = Field(default=10, ge=1, le=100, description="equal-width KV usage buckets")
    prefix_buckets: int = Field(default=4, ge=1, le=100, description="equal-width cached-ratio buckets")
    heldout_fraction: float = Field(
        default=0.1, ge=0.0, lt=0.5, description="share held out: one block in round(1 / share)"
    )
    heldout_capacity: int = Field(default=2048, ge=16, description="most recent held-out samples kept")
    heldout_block: int = Field(
        default=100, ge=1, description="consecutive samples held out together (neighbours in time share a future)"
    )

    @field_validator("waiting_edges")
    @classmethod
    def _ascending(cls, edges: tuple[int, ...]) -> tuple[int, ...]:
        if list(edges) != sorted(set(edges)) or (edges and edges[0] < 1):
            raise ValueError("must be strictly ascending positive integers")
        return edges


class XGBoostSettings(_Strict):
    """Per-regressor XGBoost parameters. Trees stay small: predict cost grows with trees x depth."""

    point_objective: Literal["reg:squarederror", "reg:absoluteerror", "reg:pseudohubererror"] = Field(
        default="reg:absoluteerror", description="loss of the point estimate (on the log-ratio over the prior)"
    )
    n_trees: int = Field(
        default=50, ge=1, le=2000, description="boosting rounds per regressor; predict cost grows with it"
    )
    max_depth: int = Field(default=5, ge=1, le=8, description="≤ 8: trees are compiled to full heaps")
    learning_rate: float = Field(default=0.15, gt=0, le=1, description="shrinkage per tree")
    subsample: float = Field(default=0.8, gt=0, le=1, description="share of samples each tree sees")
    colsample_bytree: float = Field(default=0.9, gt=0, le=1, description="share of features each tree sees")
    min_child_weight: float = Field(default=5.0, ge=0, description="smallest leaf (in samples): larger resists noise")
    reg_lambda: float = Field(default=1.0, ge=0, description="L2 regularisation of leaf weights")
    reg_alpha: float = Field(default=0.0, ge=0, description="L1 regularisation of leaf weights")
    gamma: float = Field(default=0.0, ge=0, description="smallest loss reduction that splits a leaf")
    max_bin: int = Field(default=128, ge=2, description="histogram bins per feature")
    threads: int = Field(default=1, ge=1, description="OpenMP threads per training (leave cores to the loop)")


class PriorSettings(_Strict):
    """The analytic prior's view of the engine and its uncertainty (see prior.py)."""

    ttft_p90_factor: float = Field(default=1.5, ge=1.0, description="prior p90 = prior x factor")
    tpot_p90_factor: float = Field(default=1.2, ge=1.0, description="prior TPOT p90 = prior x factor")
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="engine batch limit when the pool gives none; None: vLLM's default"
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="engine token budget per step when the pool gives none; None: vLLM's"
    )
    time_scale: float = Field(
        default=1.0, gt=0, description="engine seconds per wall second: a simulated engine's --time-scale; real 1"
    )


class LengthSettings(_Strict):
    """Output-length estimates per (tenant, model) (see prior.py)."""

    max_keys: int = Field(
        default=10_000, ge=1, description="(tenant, model) pairs tracked; least recently used dropped beyond"
    )
    half_life_samples: float = Field(default=500.0, gt=0, description="weight halves every N samples")
    min_samples: int = Field(default=20, ge=1, description="fewer samples: fall back to the model's estimate")
    default_output_tokens: int = Field(default=256, ge=1, description="used by predict() with no estimate")
    drift_rate: float = Field(
        default=0.1, ge=0, le=1, description="weight of each completion in the drift correction (0: off)"
    )
    drift_max_factor: float = Field(default=8.0, ge=1, description="the correction stays within [1/x, x]")


class PredictorAdvanced(_Strict):
    """`predictor.advanced`: expert tunables. Their defaults were measured (bench/predictor); a change
    is a benchmark's decision, not a deployment's."""

    p90_adaptation_rate: float = Field(
        default=0.005, ge=0, le=0.5, description="online p90 correction per outcome (0: off; service.py)"
    )
    prefill_rate_time_constant_s: float = Field(
        default=5.0, gt=0, description="averaging time of each endpoint's recent prefill rate (service.py)"
    )
    recent_ttft_window_s: float = Field(
        default=1.0, ge=0, description="engine seconds of first tokens that correct TTFT predictions (0: off)"
    )
    recent_ttft_weight: float = Field(
        default=0.5, ge=0, le=1, description="share of their median log error applied (service.py; 0: off)"
    )
    buffer: BufferSettings = Field(default_factory=BufferSettings, description="training samples per pool")
    xgboost: XGBoostSettings = Field(default_factory=XGBoostSettings, description="the regressors' parameters")


class PredictorSettings(_Strict):
    enabled: bool = Field(
        default=True,
        description="predict TTFT and TPOT per candidate endpoint (the latency scorer and the SLO gate need it)",
    )
    model_dir: Path | None = Field(default=None, description="where models are saved; None: not persisted")
    online_training: bool = Field(
        default=True, description="learn from finished requests; false: the prior and saved models only"
    )
    min_samples: int = Field(default=200, ge=10, description="training samples per target before a model")
    retrain_min_new_samples: int = Field(default=200, ge=1, description="new samples that trigger a retrain")
    retrain_interval_s: float = Field(default=5.0, gt=0, description="shortest time between two retrains")
    worker: Literal["thread", "process"] = Field(
        default="process", description="where XGBoost trains: one spawned process (see model.py), or a thread"
    )
    keep_versions: int = Field(default=3, ge=1, description="saved model versions kept per pool")
    accuracy_window: int = Field(default=1000, ge=10, description="recent predictions MAPE/coverage cover")
    conformal_p90: bool = Field(default=True, description="shift the p90 so held-out coverage is 90 %")
    export_samples: int = Field(
        default=2000,
        ge=0,
        le=100_000,
        description="recent outcomes per pool kept for GET /admin/predictor/samples (0: none)",
    )
    prior: PriorSettings = Field(default_factory=PriorSettings, description="the analytic prior")
    length: LengthSettings = Field(default_factory=LengthSettings, description="output-length estimates")
    advanced: PredictorAdvanced = Field(
        default_factory=PredictorAdvanced, description="expert tunables: the training buffer, XGBoost, corrections"
    )

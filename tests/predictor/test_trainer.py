from __future__ import annotations

import numpy as np
import pytest

from predictor.config import XGBoostSettings
from predictor.features import Samples, Target
from predictor.model import Decision, TargetModel, TrainingWorker, TrainJob, run_train_job, worse_beyond_noise
from tests.predictor.synthetic import POOL, samples


def _job(
    train: Samples, heldout: Samples, incumbent: dict[Target, TargetModel] | None = None, min_samples: int = 100
) -> TrainJob:
    return TrainJob(
        pool=POOL,
        version=1,
        train=train,
        heldout=heldout,
        incumbent=incumbent or {},
        xgboost=XGBoostSettings(n_trees=30),
        min_samples=min_samples,
        conformal_p90=True,
    )


@pytest.fixture(scope="module")
def world() -> dict[str, Samples]:
    rng = np.random.default_rng(11)
    return {
        "train": samples(1500, rng),
        "heldout": samples(300, rng),
        # the same traffic in a world 3x slower than the prior thinks it is
        "slow_train": samples(1500, rng, scale=3.0),
    }


@pytest.mark.slow
def test_first_training_replaces_the_prior(world: dict[str, Samples]) -> None:
    outcome = run_train_job(_job(world["train"], world["heldout"]))
    assert outcome.decisions == {Target.TTFT: Decision.TRAINED, Target.TPOT: Decision.TRAINED}
    assert outcome.model is not None and outcome.model.version == 1
    assert set(outcome.model.targets) == set(Target)
    assert all(m.heldout_mean_ms is None for m in outcome.model.targets.values())  # judged, then dropped


def test_too_few_samples_changes_nothing(world: dict[str, Samples]) -> None:
    outcome = run_train_job(_job(world["train"], world["heldout"], min_samples=10_000))
    assert outcome.model is None
    assert set(outcome.decisions.values()) == {Decision.TOO_FEW_SAMPLES}


def test_a_challenger_worse_than_the_prior_is_not_served(world: dict[str, Samples]) -> None:
    # trained on a 3x-slow world, judged on today's traffic: the prior is closer
    outcome = run_train_job(_job(world["slow_train"], world["heldout"]))
    assert outcome.decisions[Target.TTFT] is Decision.KEPT_PRIOR
    assert outcome.model is None


@pytest.mark.slow
def test_a_challenger_worse_than_the_incumbent_is_not_served(world: dict[str, Samples]) -> None:
    good = run_train_job(_job(world["train"], world["heldout"])).model
    assert good is not None
    outcome = run_train_job(_job(world["slow_train"], world["heldout"], incumbent=dict(good.targets)))
    assert outcome.decisions == {Target.TTFT: Decision.KEPT_INCUMBENT, Target.TPOT: Decision.KEPT_INCUMBENT}
    assert outcome.model is None


@pytest.mark.parametrize("kind", ["thread", pytest.param("process", marks=pytest.mark.e2e)])
@pytest.mark.slow
async def test_worker_runs_jobs_off_the_loop(kind: str, world: dict[str, Samples]) -> None:
    worker = TrainingWorker(kind)  # type: ignore[arg-type]
    await worker.start()
    try:
        outcome = await worker.run(_job(world["train"], world["heldout"]))
    finally:
        await worker.stop()
    assert outcome.model is not None and worker.jobs_run == 1
    rows = world["heldout"].rows[:4]
    local = run_train_job(_job(world["train"], world["heldout"])).model
    assert local is not None
    # the same job gives the same model in a thread or a spawned process (seeded XGBoost)
    np.testing.assert_allclose(outcome.model.latency_ms(rows), local.latency_ms(rows), rtol=1e-6)


@pytest.mark.slow
def test_a_challenger_as_good_as_the_incumbent_is_served(world: dict[str, Samples]) -> None:
    # the same traffic, the same data: equal held-out errors, and the fresher model wins the tie
    good = run_train_job(_job(world["train"], world["heldout"])).model
    assert good is not None
    outcome = run_train_job(_job(world["train"], world["heldout"], incumbent=dict(good.targets)))
    assert outcome.decisions == {Target.TTFT: Decision.TRAINED, Target.TPOT: Decision.TRAINED}


def test_worse_beyond_noise_needs_more_than_chance() -> None:
    rng = np.random.default_rng(5)
    incumbent = rng.uniform(0.0, 0.4, 400)
    # worse on average by 0.005 with per-sample differences of +-0.2: chance, the challenger serves
    noisy = incumbent + 0.005 + np.resize([0.2, -0.2], 400)
    assert not worse_beyond_noise(noisy, incumbent)
    # worse by 0.05 on every sample: refused
    assert worse_beyond_noise(incumbent + 0.05, incumbent)
    # better, or too few samples to tell: served
    assert not worse_beyond_noise(incumbent - 0.05, incumbent)
    assert not worse_beyond_noise(np.array([0.9]), np.array([0.1]))

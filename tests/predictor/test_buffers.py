from __future__ import annotations

import numpy as np

from predictor.config import BufferSettings
from predictor.features import NUM_FEATURES, Feature, StratifiedBuffer, Target


def _row(waiting: float = 0.0, kv: float = 0.0, cached_ratio: float = 0.0, marker: float = 0.0) -> np.ndarray:
    row = np.zeros(NUM_FEATURES, dtype=np.float32)
    row[Feature.WAITING] = waiting
    row[Feature.KV_USAGE_RATIO] = kv
    row[Feature.CACHED_RATIO] = cached_ratio
    row[Feature.INPUT_TOKENS] = marker
    return row


def test_bounded_however_many_samples_arrive() -> None:
    buffer = StratifiedBuffer(BufferSettings(capacity=64, heldout_capacity=16))
    rng = np.random.default_rng(0)
    for _i in range(5000):
        buffer.add(_row(float(rng.integers(0, 20)), rng.random(), rng.random()), 10.0, 1.0)
    assert buffer.train_count == 64 and sum(buffer.strata_counts()) == 64
    assert buffer.heldout_count == 16
    train, heldout = buffer.snapshot()
    assert len(train) == 64 and len(heldout) == 16


def test_homogeneous_traffic_uses_the_whole_capacity() -> None:
    """Unlike a fixed ring per stratum, one busy regime is not capped at a stratum's share."""
    buffer = StratifiedBuffer(BufferSettings(capacity=1000, heldout_fraction=0.0))
    for i in range(3000):
        buffer.add(_row(marker=i), 1.0, 1.0)
    train, _ = buffer.snapshot()
    assert len(train) == 1000
    assert sorted(train.rows[:, Feature.INPUT_TOKENS]) == list(range(2000, 3000))  # the newest


def test_rare_overload_regime_survives_a_flood_of_calm_traffic() -> None:
    buffer = StratifiedBuffer(BufferSettings(capacity=100, heldout_fraction=0.0))
    for i in range(3):
        buffer.add(_row(waiting=15, kv=0.97, marker=1000 + i), 5000.0, 80.0)
    for i in range(10_000):
        buffer.add(_row(waiting=0, kv=0.1, marker=i), 50.0, 10.0)
    train, _ = buffer.snapshot()
    overloaded = train.rows[train.rows[:, Feature.WAITING] == 15]
    assert sorted(overloaded[:, Feature.INPUT_TOKENS]) == [1000, 1001, 1002]
    calm = train.rows[train.rows[:, Feature.WAITING] == 0]
    assert sorted(calm[:, Feature.INPUT_TOKENS]) == list(range(10_000 - 97, 10_000))


def test_full_buffer_evicts_from_the_largest_stratum() -> None:
    buffer = StratifiedBuffer(BufferSettings(capacity=10, heldout_fraction=0.0))
    for i in range(6):
        buffer.add(_row(waiting=0, marker=i), 1.0, 1.0)
    for i in range(4):
        buffer.add(_row(waiting=20, marker=100 + i), 1.0, 1.0)
    for i in range(4):  # a third regime arrives: the largest strata give way, oldest first
        buffer.add(_row(waiting=4, marker=200 + i), 1.0, 1.0)
    assert sorted(c for c in buffer.strata_counts() if c) == [3, 3, 4]
    train, _ = buffer.snapshot()
    markers = set(train.rows[:, Feature.INPUT_TOKENS].tolist())
    assert {3, 4, 5, 101, 102, 103} <= markers and not {0, 1, 2, 100} & markers


def test_strata_boundaries() -> None:
    buffer = StratifiedBuffer(BufferSettings(waiting_edges=(1, 3, 6, 11), kv_buckets=10, prefix_buckets=4))
    assert buffer.num_strata == 5 * 10 * 4
    assert buffer.stratum(_row(waiting=0)) != buffer.stratum(_row(waiting=1))
    assert buffer.stratum(_row(waiting=1)) == buffer.stratum(_row(waiting=2))
    assert buffer.stratum(_row(waiting=11)) == buffer.stratum(_row(waiting=500))
    assert buffer.stratum(_row(kv=1.0)) == buffer.stratum(_row(kv=0.95))  # 100 % in the top bucket
    assert buffer.stratum(_row(cached_ratio=1.0)) == buffer.stratum(_row(cached_ratio=0.8))
    assert (
        len(
            {
                buffer.stratum(_row(w, (k + 0.5) / 10, (c + 0.5) / 4))
                for w in (0, 1, 3, 6, 11)
                for k in range(10)
                for c in range(4)
            }
        )
        == buffer.num_strata
    )


def test_heldout_slice_is_whole_blocks_of_consecutive_samples() -> None:
    buffer = StratifiedBuffer(BufferSettings(heldout_fraction=0.1, heldout_block=100))
    held = [buffer.add(_row(), 1.0, 1.0) for _ in range(5000)]
    assert sum(held) == 500 and buffer.heldout_count == 500
    assert held[:100] == [False] * 100 and held[100:200] == [True] * 100  # the second block of ten
    assert held[200:1100] == [False] * 900 and held[1100:1200] == [True] * 100
    assert not any(StratifiedBuffer(BufferSettings(heldout_fraction=0.0)).add(_row(), 1.0, 1.0) for _ in range(300))


def test_missing_targets_are_nan_and_counted_per_target() -> None:
    buffer = StratifiedBuffer(BufferSettings(heldout_fraction=0.0))
    buffer.add(_row(), 100.0, None)
    buffer.add(_row(), 120.0, 12.0)
    assert buffer.target_count(Target.TTFT) == 2 and buffer.target_count(Target.TPOT) == 1
    train, _ = buffer.snapshot()
    assert np.isnan(train.tpot_ms).sum() == 1


def test_snapshot_is_a_copy() -> None:
    buffer = StratifiedBuffer(BufferSettings(capacity=16, heldout_fraction=0.0))
    buffer.add(_row(marker=1), 1.0, 1.0)
    train, _ = buffer.snapshot()
    for i in range(40):
        buffer.add(_row(marker=10 + i), 2.0, 2.0)
    assert train.rows[0, Feature.INPUT_TOKENS] == 1 and train.ttft_ms[0] == 1.0


def test_restore_puts_samples_back_and_the_block_count_carries_on() -> None:
    settings = BufferSettings(capacity=64, heldout_capacity=16, heldout_block=4, heldout_fraction=0.25)
    before = StratifiedBuffer(settings)
    for i in range(40):
        before.add(_row(kv=(i % 10) / 10, marker=i), 10.0 + i, float("nan") if i % 3 else 1.0)
    train, heldout = before.snapshot()

    after = StratifiedBuffer(settings)
    after.restore(train, heldout)
    assert (after.train_count, after.heldout_count, after.added) == (before.train_count, before.heldout_count, 40)
    assert after.strata_counts() == before.strata_counts()
    assert after.target_count(Target.TPOT) == before.target_count(Target.TPOT)
    restored, restored_heldout = after.snapshot()
    np.testing.assert_array_equal(restored.rows, train.rows)
    np.testing.assert_array_equal(restored_heldout.ttft_ms, heldout.ttft_ms)
    assert after.is_heldout(after.added) == before.is_heldout(before.added)  # blocks continue where they were

    small = StratifiedBuffer(BufferSettings(capacity=8, heldout_capacity=16))
    small.restore(train, heldout)  # a smaller buffer than the saved one: still bounded
    assert small.train_count == 8 and sum(small.strata_counts()) == 8

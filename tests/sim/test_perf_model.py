from __future__ import annotations

import pytest

from backends.perf import roofline
from backends.perf.presets import resolve_preset

H100_8B = resolve_preset("llama-3.1-8b@h100")


def test_kv_bytes_per_token_of_llama_3_1_8b() -> None:
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert roofline.kv_bytes_per_token(H100_8B) == 131072


def test_tp_splits_kv_heads_across_devices() -> None:
    tp4 = resolve_preset("llama-3.1-70b-tp4@h100")
    assert roofline.kv_bytes_per_token_per_device(tp4) * 4 == roofline.kv_bytes_per_token(tp4)


def test_num_gpu_blocks_is_what_fits_after_the_weights() -> None:
    blocks = roofline.num_gpu_blocks(H100_8B, 16, 0.9)
    tokens = blocks * 16
    # 80 GiB x 0.9 minus ~16 GB of weights leaves room for a few hundred thousand tokens.
    assert 300_000 < tokens < 500_000
    assert roofline.num_gpu_blocks(H100_8B, 16, 0.5) < blocks


def test_a_model_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="no memory"):
        roofline.num_gpu_blocks(resolve_preset("llama-3.1-70b@h100"), 16, 0.9)


def test_empty_step_takes_no_time() -> None:
    assert roofline.step_time_s(H100_8B) == 0.0


def test_decode_step_grows_with_batch_and_context() -> None:
    one = roofline.decode_step_time_s(H100_8B, 1, 1000)
    assert roofline.decode_step_time_s(H100_8B, 64, 1000) > one
    assert roofline.decode_step_time_s(H100_8B, 1, 30000) > one


def test_prefill_is_compute_bound_and_cached_prefix_is_cheaper() -> None:
    cold = roofline.prefill_time_s(H100_8B, 4000)
    warm = roofline.prefill_time_s(H100_8B, 4000, cached_tokens=3000)
    cost = roofline.step_cost(H100_8B, [(4000, 0)])
    assert cost.compute_s > cost.memory_s
    assert warm < cold


def test_tensor_parallelism_speeds_up_and_pays_for_all_reduce() -> None:
    tp1 = resolve_preset("llama-3.1-8b@h100")
    tp4 = resolve_preset("llama-3.1-8b-tp4@h100")
    assert roofline.prefill_time_s(tp4, 8000) < roofline.prefill_time_s(tp1, 8000)
    assert roofline.step_cost(tp4, [(8000, 0)]).comm_s > 0 == roofline.step_cost(tp1, [(8000, 0)]).comm_s


def test_faster_memory_means_faster_decode() -> None:
    h100 = roofline.decode_step_time_s(resolve_preset("llama-3.1-8b@h100"), 8, 2000)
    h200 = roofline.decode_step_time_s(resolve_preset("llama-3.1-8b@h200"), 8, 2000)
    assert h200 < h100


def test_kv_transfer_time_is_bytes_over_bandwidth() -> None:
    seconds = roofline.kv_transfer_time_s(H100_8B, 1000, 25e9)
    assert seconds == pytest.approx(1000 * 131072 / 25e9)

"""The KV tiers benchmark's bound: the cold floor prices only what no earlier request shared."""

from __future__ import annotations

from backends.perf.presets import resolve_preset
from backends.perf.roofline import step_cost
from bench.kv_tiers.run import PRESET, FleetSpec, cold_floor
from bench.replay.workload import BLOCK_TOKENS, TraceRequest

SPEC = FleetSpec(engines=2, hbm_blocks=1000, dram_blocks=1000, dram_bandwidth=25e9)


def request(index: int, blocks: tuple[int, ...], tokens: int | None = None) -> TraceRequest:
    return TraceRequest(index, float(index), tokens or len(blocks) * BLOCK_TOKENS, 16, blocks)


def test_a_first_turn_costs_its_whole_prefill_on_an_idle_engine() -> None:
    preset = resolve_preset(PRESET)
    chunk = SPEC.max_num_batched_tokens
    (floor,) = cold_floor([request(0, tuple(range(40)))], SPEC)  # 20,480 tokens: three chunks
    expected = sum(step_cost(preset, [(min(chunk, 20_480 - d), d)]).total_s for d in range(0, 20_480, chunk))
    assert floor == expected


def test_a_later_turn_pays_only_for_what_no_earlier_request_shared() -> None:
    first = request(0, tuple(range(40)))
    follow_up = request(1, (*range(40), 100, 101))  # the first turn's 40 blocks, then 2 new ones
    stranger = request(2, (200, *range(1, 42)))  # different first block: nothing shared as a prefix
    floors = cold_floor([first, follow_up, stranger], SPEC)
    assert floors[1] < floors[0] / 5  # 1,024 new tokens after 20,480 cached
    assert floors[2] > floors[0]  # 42 blocks computed from the start


def test_a_fully_shared_prompt_still_computes_its_last_token() -> None:
    first = request(0, tuple(range(8)))
    again = request(1, tuple(range(8)))
    floors = cold_floor([first, again], SPEC)
    assert 0 < floors[1] < floors[0]

"""The PD topology benchmark's simulated fleet: transfers are charged by link, and pairing sees them."""

from __future__ import annotations

import random

import pytest

from bench.pd_topology.run import Job, Spec, arrival_rate, no_queue_floor, simulate, workload


def jobs_and_arrivals(spec: Spec) -> tuple[list[Job], list[float]]:
    """The tests' small workload (40 requests) and its Poisson arrival times at half the fleet's rate."""
    jobs = workload(7, 40, 2048)
    rate = arrival_rate(jobs, spec, 0.5)
    rng = random.Random(3)
    at, arrivals = 0.0, []
    for _ in jobs:
        at += rng.expovariate(rate)
        arrivals.append(at)
    return jobs, arrivals


def run(variant: str, spec: Spec) -> tuple[float, int, int, int]:
    jobs, arrivals = jobs_and_arrivals(spec)
    out = simulate(variant, jobs, arrivals, spec, seed=5)
    assert len(out.ttft_s) == len(jobs) and all(t > 0 for t in out.ttft_s)
    return out.transfer_s, out.cross_rack, out.disaggregated, len(jobs)


@pytest.mark.slow
def test_aware_pairs_stay_in_their_rack_and_move_their_kv_faster() -> None:
    spec = Spec(rack_gbps=50.0, spine_gbps=5.0)
    blind_s, blind_cross, blind_pd, n = run("blind", spec)
    aware_s, aware_cross, aware_pd, _ = run("aware", spec)
    assert blind_pd == aware_pd == n  # no shared prefixes: every request has a prefill leg
    assert blind_cross > n // 5 and aware_cross < blind_cross
    assert aware_s < blind_s


@pytest.mark.slow
def test_a_spine_as_fast_as_the_rack_charges_the_same_per_token() -> None:
    fast, _, _, _ = run("blind", Spec(rack_gbps=50.0, spine_gbps=50.0, spine_latency_ms=0.05))
    slow, _, _, _ = run("blind", Spec(rack_gbps=50.0, spine_gbps=5.0))
    assert fast < slow


@pytest.mark.slow
def test_the_no_spine_bound_charges_every_pair_the_racks_link() -> None:
    spec = Spec(rack_gbps=50.0, spine_gbps=5.0)
    bound_s, bound_cross, _, _ = run("no-spine", spec)
    aware_s, _, _, _ = run("aware", spec)
    blind_s, _, _, _ = run("blind", spec)
    assert bound_cross > 0  # pairs still cross racks, at the rack's speed
    assert bound_s < blind_s and bound_s <= aware_s * 1.1


def test_no_request_beats_its_no_queue_floor() -> None:
    spec = Spec(rack_gbps=50.0, spine_gbps=5.0)
    jobs, arrivals = jobs_and_arrivals(spec)
    floors = no_queue_floor(jobs, spec)
    assert len(floors) == len(jobs) and all(f > 0 for f in floors)
    out = simulate("no-spine", jobs, arrivals, spec, seed=5)
    # every TTFT is at least its own floor, so the sorted TTFTs dominate the sorted floors
    assert all(t >= f for t, f in zip(sorted(out.ttft_s), sorted(floors), strict=True))
    longest = max(range(len(jobs)), key=lambda i: len(jobs[i].prompt_ids))
    shortest = min(range(len(jobs)), key=lambda i: len(jobs[i].prompt_ids))
    assert floors[longest] > floors[shortest]

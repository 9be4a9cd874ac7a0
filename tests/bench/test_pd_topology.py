"""The PD topology benchmark's simulated fleet: transfers are charged by link, and pairing sees them."""

from __future__ import annotations

import random

from bench.pd_topology.run import Spec, arrival_rate, simulate, workload


def run(variant: str, spec: Spec) -> tuple[float, int, int, int]:
    jobs = workload(7, 40, 2048)
    rate = arrival_rate(jobs, spec, 0.5)
    rng = random.Random(3)
    at, arrivals = 0.0, []
    for _ in jobs:
        at += rng.expovariate(rate)
        arrivals.append(at)
    out = simulate(variant, jobs, arrivals, spec, seed=5)
    assert len(out.ttft_s) == len(jobs) and all(t > 0 for t in out.ttft_s)
    return out.transfer_s, out.cross_rack, out.disaggregated, len(jobs)


def test_aware_pairs_stay_in_their_rack_and_move_their_kv_faster() -> None:
    spec = Spec(rack_gbps=50.0, spine_gbps=5.0)
    blind_s, blind_cross, blind_pd, n = run("blind", spec)
    aware_s, aware_cross, aware_pd, _ = run("aware", spec)
    assert blind_pd == aware_pd == n  # no shared prefixes: every request has a prefill leg
    assert blind_cross > n // 5 and aware_cross < blind_cross
    assert aware_s < blind_s


def test_a_spine_as_fast_as_the_rack_charges_the_same_per_token() -> None:
    fast, _, _, _ = run("blind", Spec(rack_gbps=50.0, spine_gbps=50.0, spine_latency_ms=0.05))
    slow, _, _, _ = run("blind", Spec(rack_gbps=50.0, spine_gbps=5.0))
    assert fast < slow

"""A pool's request mix: before anything finished it follows what the arriving requests say about
themselves (their prompts, their `max_tokens`), so a cold pool's first plan is not sized for the
default mix; the first finished request takes over, and finishes teach it from then on."""

from __future__ import annotations

from gateway.autoscale.loop import PoolTraffic
from predictor.prior import Mix


def test_a_cold_pool_takes_its_mix_from_the_arrivals() -> None:
    traffic = PoolTraffic()
    assert traffic.mix == Mix()  # nothing seen: the default
    traffic.arrived(2400, 32, now_s=1.0)  # a code model: long prompts, short outputs
    assert traffic.mix == Mix(2400.0, 32.0)
    prefill, decode, requests = traffic.take()
    assert (prefill, decode, requests) == (2400.0, 32.0, 1)
    traffic.arrived(1600, 16, now_s=1.1)
    assert 2300 < traffic.mix.prompt_tokens < 2400 and 31 < traffic.mix.output_tokens < 32


def test_max_tokens_only_bounds_the_output_it_does_not_raise_it() -> None:
    traffic = PoolTraffic()
    traffic.arrived(500, 4096, now_s=1.0)  # a generous bound says little about the output
    assert traffic.mix.output_tokens == Mix().output_tokens
    unbounded = PoolTraffic()
    unbounded.arrived(500, None, now_s=1.0)
    assert unbounded.mix == Mix(500.0, Mix().output_tokens)


def test_the_first_finished_request_replaces_the_guess_and_arrivals_stop_moving_it() -> None:
    traffic = PoolTraffic()
    for _ in range(5):
        traffic.arrived(2400, 32, now_s=1.0)
    traffic.finished(prompt_tokens=800, cached_tokens=0, output_tokens=100)
    assert traffic.mix == Mix(800.0, 100.0)
    traffic.arrived(5000, 8, now_s=2.0)
    assert traffic.mix == Mix(800.0, 100.0)  # what finished is what the mix learns from now
    _, decode, _ = traffic.take()
    assert decode == 5 * 32 + 8  # each arrival's expected output: the mix, at most its own bound


def test_the_windows_arrival_times_count_the_late_ones_and_stay_bounded() -> None:
    traffic = PoolTraffic()
    for at_s in (1.0, 1.2, 1.7, 1.9):
        traffic.arrived(100, 10, now_s=at_s)
    assert traffic.arrived_since(1.5) == 2 and traffic.arrived_since(0.0) == 4
    traffic.take()
    assert traffic.arrived_since(0.0) == 0  # a new window
    for i in range(10_000):
        traffic.arrived(100, 10, now_s=2.0 + i * 1e-4)
    assert len(traffic.times) == 4096 and traffic.arrived_since(2.9) == 1000

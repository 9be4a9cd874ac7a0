"""Topology-aware PD pairing: the KV transfer priced by link, and the pair the router then chooses."""

from __future__ import annotations

import pytest

from backends.config import PoolConfig
from backends.fleet import Pool
from backends.perf.presets import resolve_preset
from backends.types import Endpoint, Role, Topology
from policies.routing.config import LinkClassesConfig
from policies.routing.pd import PairCosts, choose_pair, price
from policies.routing.pipeline import build_router
from tests.policies.routing.factories import NOW_S, candidate, context, endpoint, request, token_ids

LLAMA_8B_KV_BYTES = 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head dim x bf16


def costs() -> PairCosts:
    return PairCosts(resolve_preset("llama-3.1-8b@h100"), LinkClassesConfig())


@pytest.mark.parametrize(
    ("link", "tokens", "expected_s"),
    [
        pytest.param("same_rack", 4096, 0.05e-3 + 4096 * LLAMA_8B_KV_BYTES / 50e9, id="same-rack"),
        pytest.param("cross_rack", 4096, 0.2e-3 + 4096 * LLAMA_8B_KV_BYTES / 12.5e9, id="cross-rack"),
        pytest.param("cross_zone", 1000, 2e-3 + 1000 * LLAMA_8B_KV_BYTES / 1.25e9, id="cross-zone"),
        pytest.param("same_node", 4096, 4096 * LLAMA_8B_KV_BYTES / 450e9, id="nvlink"),
        pytest.param(None, 4096, 0.0, id="unlabelled-is-free"),
        pytest.param("cross_rack", 0, 0.0, id="nothing-to-move"),
    ],
)
def test_transfer_time_is_latency_plus_bytes_over_bandwidth(link: str | None, tokens: int, expected_s: float) -> None:
    assert costs().kv_bytes_per_token == LLAMA_8B_KV_BYTES
    assert costs().transfer_s(link, tokens) == pytest.approx(expected_s)


def test_prefill_time_grows_with_the_backlog_and_shrinks_with_the_cache() -> None:
    c = costs()
    idle = c.prefill_s(0, 4096, 0)
    assert 0 < idle < c.prefill_s(50_000, 4096, 0)
    assert c.prefill_s(0, 1024, 3072) < idle
    assert c.prefill_s(0, 0, 0) == 0.0


def labelled(name: str, role: Role, rack: str, **kwargs: int | float) -> Endpoint:
    e = endpoint(name, pool="pd", role=role, **kwargs)  # type: ignore[arg-type]
    e.topology = Topology(node=name, rack=rack, zone="z")
    return e


def test_choose_pair_keeps_the_transfer_in_the_rack() -> None:
    ctx = context(4096)
    d1, d2 = candidate(labelled("d1", Role.DECODE, "r1")), candidate(labelled("d2", Role.DECODE, "r2"))
    p1, p2 = candidate(labelled("p1", Role.PREFILL, "r1")), candidate(labelled("p2", Role.PREFILL, "r2"))
    c = costs()
    blind = price(ctx, d1, p2, c)  # what independent choices may give: across the spine
    assert blind.link == "cross_rack"
    pair = choose_pair(ctx, [(d1, 0.9), (d2, 0.9)], blind, [p1, p2], c, 0.1, 512, None)
    assert pair.link == "same_rack" and pair.cost_s < blind.cost_s
    assert (pair.decode.id, pair.prefill.id) in {("d1", "p1"), ("d2", "p2")}


def test_choose_pair_crosses_racks_when_waiting_costs_more_than_the_transfer() -> None:
    ctx = context(4096)
    d1, d2 = candidate(labelled("d1", Role.DECODE, "r1")), candidate(labelled("d2", Role.DECODE, "r2"))
    p1 = candidate(labelled("p1", Role.PREFILL, "r1", prefill_tokens=200_000))
    p2 = candidate(labelled("p2", Role.PREFILL, "r2"))
    c = costs()
    own = price(ctx, d1, p1, c)
    # d2 is far below d1 in the decode pipeline: only d1 may decode, so the pair crosses to the idle p2
    pair = choose_pair(ctx, [(d1, 0.9), (d2, 0.5)], own, [p1, p2], c, 0.1, 512, None)
    assert (pair.decode.id, pair.prefill.id, pair.link) == ("d1", "p2", "cross_rack")
    # within the slack the whole pair moves to the idle rack instead
    pair = choose_pair(ctx, [(d1, 0.9), (d2, 0.85)], own, [p1, p2], c, 0.1, 512, None)
    assert (pair.decode.id, pair.prefill.id, pair.link) == ("d2", "p2", "same_rack")
    # a prefill endpoint over the backlog limit is never paired
    busy = choose_pair(ctx, [(d1, 0.9)], price(ctx, d1, p2, c), [p1, p2], c, 0.1, 512, 1000)
    assert busy.prefill.id == "p2"


def test_choose_pair_leaves_unlabelled_endpoints_as_the_pipelines_chose() -> None:
    ctx = context(4096)
    d1, d2 = candidate(endpoint("d1", role=Role.DECODE)), candidate(endpoint("d2", role=Role.DECODE))
    p1 = candidate(endpoint("p1", role=Role.PREFILL, prefill_tokens=50_000))
    p2 = candidate(endpoint("p2", role=Role.PREFILL))
    own = price(ctx, d1, p1, costs())
    assert choose_pair(ctx, [(d1, 0.9), (d2, 0.9)], own, [p1, p2], costs(), 0.1, 512, None) is own


def two_rack_pool() -> Pool:
    eps = [
        labelled(f"{role.value}-{rack}", role, rack) for rack in ("r1", "r2") for role in (Role.PREFILL, Role.DECODE)
    ]
    return Pool(PoolConfig(name="pd", model="m", roles={"prefill": 2, "decode": 2}), endpoints=eps)


@pytest.mark.parametrize("aware", [True, False])
def test_router_pairs_within_a_rack_when_topology_aware(aware: bool) -> None:
    racks = []
    for seed in range(24):
        r = build_router({"seed": seed, "pd": {"topology": {"aware": aware}}})
        d = r.route(request(token_ids(4096, start=seed)), two_rack_pool(), NOW_S)
        assert d is not None and d.prefill_endpoint is not None and d.pd_reason == "disaggregated"
        racks.append(d.endpoint.topology.rack == d.prefill_endpoint.topology.rack)
    if aware:
        assert all(racks)
    else:  # blind: the two choices are independent, so some pairs cross the spine
        assert not all(racks)


def test_router_debug_shows_the_pair_cost() -> None:
    r = build_router({"seed": 1})
    d = r.route(request(token_ids(4096), debug=True), two_rack_pool(), NOW_S)
    assert d is not None and d.scores["pair"]["cost_s"] > 0


def test_router_moves_the_decode_to_the_rack_whose_prefill_is_free() -> None:
    for seed in range(12):
        eps = two_rack_pool()
        busy = next(e for e in eps.endpoints if e.id == "prefill-r1")
        busy.inflight.prefill_tokens = 100_000  # seconds of prefill queued in rack r1
        d = build_router({"seed": seed}).route(request(token_ids(4096, start=seed)), eps, NOW_S)
        assert d is not None and d.prefill_endpoint is not None
        assert (d.endpoint.id, d.prefill_endpoint.id) == ("decode-r2", "prefill-r2")
        assert d.reason == "load"

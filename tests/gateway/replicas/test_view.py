"""Peers' load reports fold into each endpoint's InFlight, replace each other, and age out."""

from __future__ import annotations

from backends.types import Endpoint
from gateway.replicas.bus import RemoteLoads


def _endpoints() -> dict[str, Endpoint]:
    return {
        i: Endpoint(id=i, pool="p", base_url=f"http://h/{i}", engine="vllm", served_model="m") for i in ("e0", "e1")
    }


def test_reports_replace_and_sum_over_peers() -> None:
    eps = _endpoints()
    view = RemoteLoads(ttl_s=3.0, lookup=eps.get)
    local = eps["e0"].inflight.begin(50)  # this replica's own request
    view.heard("a", 0, 0.0)
    view.report("a", [("e0", 2, 100, 0), ("e1", 1, 0, 900)])
    view.heard("b", 0, 0.0)
    view.report("b", [("e0", 1, 10, 0), ("unknown", 5, 5, 5)])
    e0 = eps["e0"].inflight
    assert (e0.requests, e0.prefill_tokens) == (4, 160)
    assert e0.local() == (1, 50, 0)
    view.heard("a", 1, 0.5)
    view.report("a", [("e1", 1, 0, 900)])  # a's requests on e0 ended: absent from its report
    assert (e0.requests, e0.prefill_tokens) == (2, 60)
    local.end()
    assert e0.local() == (0, 0, 0) and e0.requests == 1


def test_silent_peers_age_out_and_gaps_are_counted() -> None:
    eps = _endpoints()
    view = RemoteLoads(ttl_s=3.0, lookup=eps.get)
    view.heard("a", 0, 0.0)
    view.report("a", [("e1", 3, 0, 300)])
    view.heard("b", 4, 2.0)
    view.report("b", [("e1", 1, 0, 100)])
    view.heard("b", 9, 2.5)  # batches 5..8 never arrived
    assert view.peers["b"].gaps == 4
    assert view.expire(3.5) == ["a"]
    assert eps["e1"].inflight.requests == 1
    assert view.expire(10.0) == ["b"]
    assert eps["e1"].inflight.requests == 0 and eps["e1"].inflight.remote_requests == 0


def test_peers_are_bounded() -> None:
    eps = _endpoints()
    view = RemoteLoads(ttl_s=3.0, lookup=eps.get, max_peers=2)
    for i, name in enumerate(("a", "b", "c")):
        view.heard(name, 0, float(i))
        view.report(name, [("e0", 1, 0, 0)])
    assert set(view.peers) == {"b", "c"}
    assert eps["e0"].inflight.requests == 2

"""The program slot reserve's counts across replicas (`ProgramActivity.report` / `set_remote`): a peer's
programs add to the local ones, a program on both replicas counts once, a program waiting on either is
not light, a peer's rows replace its previous ones and go with it, and every map stays bounded."""

from __future__ import annotations

import pytest

from gateway.flow import activity
from gateway.flow.activity import ProgramActivity
from policies.flow.saturation import Standing, held


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def pair() -> tuple[ProgramActivity, ProgramActivity]:
    clock = Clock()
    return ProgramActivity(active_s=10.0, now=clock), ProgramActivity(active_s=10.0, now=clock)


def exchange(a: ProgramActivity, b: ProgramActivity) -> None:
    """One round of the bus: each replica hands its report to the other."""
    a.set_remote("gw-b", b.report())
    b.set_remote("gw-a", a.report())


def test_a_peers_calls_add_to_the_local_counts() -> None:
    a, b = pair()
    for _ in range(3):
        a.inflight("p", "t", "wide", 1)
        b.inflight("p", "t", "wide", 1)
    b.inflight("p", "t", "small", 1)
    b.inflight("p", "t", "small", -1)  # between two turns: active and light, on b only
    assert a.standing("p", "t", "wide") == Standing(3, 3, 1, 0)  # alone: a sees no one to keep slots for
    exchange(a, b)
    # every replica sees the fleet: the wide program holds 6 of the tenant's 6, beside a light program
    assert a.standing("p", "t", "wide") == Standing(6, 6, 2, 1)
    assert b.standing("p", "t", "wide") == Standing(6, 6, 2, 1)
    assert held(a.standing("p", "t", "wide"))
    assert a.standing("p", "t", "small") == Standing(0, 6, 2, 1)  # known from b: not counted twice


def test_a_program_waiting_on_either_replica_is_not_light() -> None:
    a, b = pair()
    a.inflight("p", "t", "wide", 1)
    a.inflight("p", "t", "small", 1)
    a.inflight("p", "t", "small", -1)
    b.waiting("p", "t", "small", 1)  # its next call waits in b's room
    exchange(a, b)
    standing = a.standing("p", "t", "wide")
    assert (standing.active, standing.light_others) == (2, 0)
    a.waiting("p", "t", "small", 1)  # waiting on both: still one program waiting
    assert a.standing("p", "t", "wide").light_others == 0
    b.waiting("p", "t", "small", -1)
    a.waiting("p", "t", "small", -1)
    exchange(a, b)
    assert a.standing("p", "t", "wide").light_others == 1


def test_a_peers_report_replaces_the_last_and_goes_with_the_peer() -> None:
    a, b = pair()
    b.inflight("p", "t", "x", 1)
    b.inflight("p", "t", "x", 1)
    exchange(a, b)
    assert a.standing("p", "t", "x").inflight == 2
    b.inflight("p", "t", "x", -1)
    exchange(a, b)
    assert a.standing("p", "t", "x") == Standing(1, 1, 1, 0)  # replaced, not added
    a.drop_remote("gw-b")
    assert a.standing("p", "t", "x") == Standing(0, 0, 1, 0)
    exchange(a, b)
    a.drop_remote()
    assert a.standing("p", "t", "x") == Standing(0, 0, 1, 0)


def test_local_programs_coming_and_going_keep_the_overlap() -> None:
    a, b = pair()
    b.inflight("p", "t", "x", 1)
    b.inflight("p", "t", "y", 1)
    exchange(a, b)
    a.inflight("p", "t", "x", 1)  # x now on both: still two programs
    assert a.standing("p", "t", "x") == Standing(2, 3, 2, 1)
    a.inflight("p", "t", "x", -1)
    a.now.t += 11.0  # type: ignore[attr-defined]
    a.standing("p", "t", "z")  # a read forgets x here (idle); b still reports it
    assert a.standing("p", "t", "x") == Standing(1, 2, 2, 1)


def test_the_report_is_the_local_view_and_expires_idle_programs() -> None:
    a, _ = pair()
    a.inflight("p", "t", "busy", 1)
    a.waiting("p", "t", "queued", 1)
    a.inflight("p", "t", "done", 1)
    a.inflight("p", "t", "done", -1)
    assert sorted(a.report()) == [("p", "t", "busy", 1, 0), ("p", "t", "done", 0, 0), ("p", "t", "queued", 0, 1)]
    assert a.report() is a.report()  # unchanged: the same list
    a.now.t += 11.0  # type: ignore[attr-defined]
    assert sorted(a.report()) == [("p", "t", "busy", 1, 0), ("p", "t", "queued", 0, 1)]
    a.set_remote("gw-b", [("p", "t", "elsewhere", 1, 0)])
    assert all(row[2] != "elsewhere" for row in a.report())  # a peer's programs are never re-published


@pytest.mark.slow
def test_peers_and_their_rows_are_bounded() -> None:
    a, _ = pair()
    rows = [("p", "t", f"x{i}", 1, 0) for i in range(activity._MAX_REPORT_ROWS + 10)]
    a.set_remote("gw-big", rows)
    assert a.standing("p", "t", "x0").active == activity._MAX_REPORT_ROWS
    for i in range(activity._MAX_PROGRAM_PEERS + 5):
        a.set_remote(f"gw{i}", [("p", "t", "y", 1, 0)])
    assert len(a._peers) == activity._MAX_PROGRAM_PEERS
    assert a.standing("p", "t", "y").inflight == activity._MAX_PROGRAM_PEERS  # the first peers went
    a.drop_remote()
    assert not a._remote and not a._peers


def test_status_shows_the_fleet_beside_this_replica() -> None:
    a, b = pair()
    a.inflight("p", "t", "wide", 1)
    a.inflight("p", "t", "wide", 1)
    b.inflight("p", "t", "wide", 1)
    b.waiting("p", "t", "wide", 1)
    b.inflight("p", "t", "solo", 1)
    b.inflight("p", "u", "other", 1)  # a tenant only b has seen
    assert a.status() == {"p/t": {"programs": 1, "inflight": 2, "waiting_programs": 0}}  # alone: no cluster
    exchange(a, b)
    assert a.status() == {
        "p/t": {
            "programs": 1,
            "inflight": 2,
            "waiting_programs": 0,
            "cluster": {"programs": 2, "inflight": 4, "waiting_programs": 1},  # `wide` counted once
        },
        "p/u": {
            "programs": 0,
            "inflight": 0,
            "waiting_programs": 0,
            "cluster": {"programs": 1, "inflight": 1, "waiting_programs": 0},
        },
    }
    a.waiting("p", "t", "wide", 1)  # waiting on both replicas: one program waiting
    assert a.status()["p/t"] == {
        "programs": 1,
        "inflight": 2,
        "waiting_programs": 1,
        "cluster": {"programs": 2, "inflight": 4, "waiting_programs": 1},
    }
    a.drop_remote()
    assert a.status() == {"p/t": {"programs": 1, "inflight": 2, "waiting_programs": 1}}

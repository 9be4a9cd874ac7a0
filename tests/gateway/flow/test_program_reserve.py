"""The program slot reserve at the gate and in the room (`program_reserve_slots`): inside a tenant with
program fairness, a program over its share of the tenant's calls in flight starts only on an endpoint
that keeps the reserve free while a smaller program is light; another program of the tenant goes
meanwhile. And the counts it reads (`ProgramActivity`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import cast

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Pool
from backends.types import Endpoint, EndpointState
from gateway.flow.activity import ProgramActivity
from gateway.flow.checks import Saturation
from gateway.flow.gate import Gate, Turn
from gateway.flow.queue import Blocked, FlowQueue, FlowRequest
from gateway.request import RequestContext, Routed
from policies.flow.order import MemoryCounters, band_rank
from policies.flow.saturation import FlowSettings
from policies.holder import PolicyHolder
from policies.policy import Policy
from policies.routing.types import RouteDecision
from policies.schema import PoliciesConfig
from tests.support.polling import wait_for_async

NORMAL = band_rank(0)
SATURATION = {"max_engine_waiting": 0, "program_reserve_slots": 3, "max_stats_age_s": 3600}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def endpoint(name: str) -> Endpoint:
    return Endpoint(
        id=f"p/{name}", pool="p", base_url=f"http://{name}", engine="sim", served_model="m", state=EndpointState.READY
    )


def setup(*, slots: int = 3, fair: bool = True) -> tuple[Gate, Pool, list[Endpoint]]:
    eps = [endpoint("a"), endpoint("b")]
    config = PoolConfig(
        name="p", model="m", max_num_seqs=8, endpoints=[StaticEndpointConfig(url=e.base_url) for e in eps]
    )
    pool = Pool(config, endpoints=eps)
    settings = FlowSettings.model_validate({"saturation": {**SATURATION, "program_reserve_slots": slots}})
    queue = FlowQueue(MemoryCounters(), program_half_life=lambda tenant: 60.0 if fair else None)
    holder = PolicyHolder(Policy(PoliciesConfig.model_validate({})))
    gate = Gate(queue, settings, holder, checks=[Saturation(queue, settings)])
    # one tenant: the wide program holds ten calls and waits with more; a one-call program is active
    programs = queue.program_activity
    programs.inflight("p", "t", "wide", 10)
    programs.waiting("p", "t", "wide", 20)
    programs.inflight("p", "t", "small", 1)
    eps[0].inflight.requests, eps[1].inflight.requests = 6, 5  # a: 2 free, b: 3 free
    return gate, pool, eps


def ask(gate: Gate, pool: Pool, on: Endpoint, program: str) -> Routed | Blocked:
    def reroute(more: Collection[str]) -> Routed | None:
        left = [e for e in pool.servable() if e.id not in more]
        return Routed(pool, RouteDecision(left[0], "load")) if left else None

    request = FlowRequest("r", "t", NORMAL, 400.0, 1.0, float("inf"), 0, program=program)
    turn = Turn(cast(RequestContext, None), request, pool.name, 0.0, float("inf"))  # the check reads no context
    return gate._ask(turn, Routed(pool, RouteDecision(on, "load")), reroute)


def test_the_wide_program_leaves_each_endpoints_last_slots_to_the_small_one() -> None:
    gate, pool, (a, b) = setup()
    assert ask(gate, pool, a, "wide") is Blocked.PROGRAM  # a: 2 free, b: 3 free, neither keeps 3 after it
    small = ask(gate, pool, a, "small")
    assert isinstance(small, Routed) and small.endpoint is a  # the small program takes any free slot
    a.inflight.requests = 2  # six free on a: it keeps three after one more
    wide = ask(gate, pool, b, "wide")
    assert isinstance(wide, Routed) and wide.endpoint is a  # avoided b, which would keep two


def test_a_new_program_counts_as_light_and_the_reserve_goes_when_nobody_is_light() -> None:
    gate, pool, (a, _) = setup()
    gate.queue.program_activity.waiting("p", "t", "small", 1)  # the small program waits: the room serves it
    gate.queue.program_activity.inflight("p", "t", "small", -1)
    opened = ask(gate, pool, a, "wide")
    assert isinstance(opened, Routed)  # nobody light to keep the slots for
    new = ask(gate, pool, a, "newcomer")  # a program never seen is under its share
    assert isinstance(new, Routed)


def test_off_without_the_setting_or_without_program_fairness() -> None:
    for gate, pool, (a, _) in (setup(slots=0), setup(fair=False)):
        opened = ask(gate, pool, a, "wide")
        assert isinstance(opened, Routed) and opened.endpoint is a


async def test_a_program_held_back_passes_the_turn_to_another_program_of_its_tenant() -> None:
    queue = FlowQueue(MemoryCounters(), recheck_s=10.0, program_half_life=lambda tenant: 60.0)
    order: list[str] = []
    free = {"n": 0}

    def ready_for(program: str) -> object:
        def ready() -> str | Blocked:
            if not free["n"]:
                return Blocked.POOL
            return Blocked.PROGRAM if program == "wide" else "go"

        return ready

    async def run(name: str, program: str) -> None:
        request = FlowRequest(name, "t", NORMAL, 100.0, 1.0, time.monotonic() + 30.0, 0, program=program)
        await queue.hold("p", request, ready_for(program))  # type: ignore[arg-type]
        free["n"] -= 1
        order.append(name)

    queue.programs.charge("t", "small", 5000.0, 60.0)  # the small program ranks behind the wide one
    tasks = [asyncio.create_task(run(f"w{i}", "wide")) for i in range(6)]
    tasks.append(asyncio.create_task(run("s0", "small")))
    await wait_for_async(lambda: queue.depth("p") == 7)
    free["n"] = 1
    queue.notify("p")
    await wait_for_async(lambda: order == ["s0"])  # every wide request passed over in one round
    assert queue.depth("p") == 6
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_the_room_and_the_leases_keep_the_counts() -> None:
    clock = Clock()
    queue = FlowQueue(MemoryCounters(), program_half_life=lambda tenant: 60.0 if tenant == "t" else None, now=clock)
    request = FlowRequest("r", "t", NORMAL, 100.0, 1.0, clock() + 30.0, 0, program="p1")
    lease = queue._dispatch(queue._room("p"), request, queued_s=0.0, floor=None)
    standing = queue.program_activity.standing("p", "t", "p1")
    assert (standing.inflight, standing.tenant_inflight, standing.active) == (1, 1, 1)
    lease.finished(None)
    assert queue.program_activity.standing("p", "t", "p1").inflight == 0
    other = FlowRequest("r2", "u", NORMAL, 100.0, 1.0, clock() + 30.0, 0, program="p1")
    queue._dispatch(queue._room("p"), other, queued_s=0.0, floor=None)  # no program fairness: not counted
    assert queue.program_activity.standing("p", "u", "p1").tenant_inflight == 0


def test_activity_expires_idle_programs_and_keeps_busy_ones() -> None:
    clock = Clock()
    activity = ProgramActivity(active_s=10.0, now=clock)
    activity.inflight("p", "t", "busy", 1)
    activity.inflight("p", "t", "idle", 1)
    activity.inflight("p", "t", "idle", -1)
    activity.waiting("p", "t", "queued", 1)
    assert activity.standing("p", "t", "busy") == activity.standing("p", "t", "busy")
    standing = activity.standing("p", "t", "busy")
    assert (standing.active, standing.light_others, standing.tenant_inflight) == (3, 1, 1)  # idle is light
    clock.t += 11.0
    standing = activity.standing("p", "t", "busy")
    assert (standing.active, standing.light_others) == (2, 0)  # idle forgotten; queued still waits
    activity.inflight("p", "t", "gone", -1)  # an end of a program never seen (or forgotten) is ignored
    assert activity.standing("p", "t", "gone").active == 3  # asking: counted once, as new


def test_activity_is_bounded() -> None:
    activity = ProgramActivity(max_groups=2, max_programs=3)
    for i in range(10):
        activity.inflight("p", "t", f"p{i}", 1)
    standing = activity.standing("p", "t", "p9")
    assert standing.active == 3 and standing.tenant_inflight == 3  # the forgotten took their counts
    for tenant in ("u", "v", "w"):
        activity.waiting("p", tenant, "x", 1)
    assert len(activity._groups) == 2

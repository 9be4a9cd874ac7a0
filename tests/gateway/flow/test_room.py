"""The gate's one room with two checks, in the walk, in process: one check holds the request until it
is told the pool opened, another keeps it off the first endpoint; the room waits and routes again in
one place, asks every check again on every wake, and a check's refusal or a wait's own answer at the
deadline is what the client gets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from gateway.errors import Rejected
from gateway.flow.gate import GO, Avoid, Check, Gate, Refuse, Turn, Verdict, Wait
from gateway.flow.queue import Blocked, FlowQueue
from gateway.request import Detour, Routed
from policies.flow.order import MemoryCounters
from policies.flow.saturation import FlowSettings
from policies.holder import PolicyHolder
from policies.policy import Policy
from policies.schema import PoliciesConfig
from policies.types import Rejection
from sim.server import run_sim_instances
from tests.gateway.request.walk import body_json, build, chat_request, fleet, policy
from tests.support.polling import wait_for_async


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    async with run_sim_instances("llama-3.1-8b@h100", 2, time_scale=50.0, served_model_names=["llama-3.1-8b"]) as urls:
        yield urls


def _closed(waited_s: float) -> Detour:
    rejection = Rejection(503, f"closed for {waited_s:.1f} s", "server_error", "closed", reason="closed")
    return Detour("closed", Rejected(rejection), fallback=False)


@dataclass
class Closed(Check):
    """Says wait (the whole pool) until `open` is set; what a request that waits it out is told."""

    open: bool = False
    asked: list[str] = field(default_factory=list)

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        self.asked.append(routed.endpoint.id)
        return GO if self.open else Wait(Blocked.POOL, "closed", _closed)


@dataclass
class NotOn(Check):
    """Keeps requests off `endpoint` (refused when no other is left); hears where they went."""

    endpoint: str
    asked: list[str] = field(default_factory=list)
    went_to: list[str] = field(default_factory=list)

    def check(self, turn: Turn, routed: Routed) -> Verdict:
        self.asked.append(routed.endpoint.id)
        if routed.endpoint.id != self.endpoint:
            return GO
        rejection = Rejection(503, "nowhere left", "server_error", "nowhere", reason="nowhere")
        return Avoid([self.endpoint], Refuse(Detour("nowhere", Rejected(rejection), fallback=False)))

    def went(self, turn: Turn, routed: Routed) -> None:
        self.went_to.append(routed.endpoint.id)


def room(*checks: Check, max_queue_ms: float = 10000) -> Gate:
    doc = policy().config.model_dump(mode="json")
    doc["flow_control"] = {"bands": {"normal": {"max_queue_ms": max_queue_ms, "on_timeout": 503}}}
    holder = PolicyHolder(Policy(PoliciesConfig.model_validate(doc)))
    return Gate(FlowQueue(MemoryCounters(), recheck_s=0.01), FlowSettings(), holder, checks=list(checks))


async def test_the_room_holds_for_one_check_and_routes_again_for_the_other(engines: list[str]) -> None:
    closed, not_first = Closed(), NotOn("small/both-s0")
    gate = room(closed, not_first)
    walk = build(fleet({"small": engines}), gate=gate)
    task = asyncio.create_task(walk.director.handle(chat_request("small"), "chat"))
    await wait_for_async(lambda: gate.queue.depth("small") == 1)
    await wait_for_async(lambda: len(closed.asked) >= 3)  # asked again on the room's rechecks
    assert walk.router.dispatched == [] and not not_first.asked  # a wait stops the checks after it
    closed.open = True
    gate.queue.notify("small")
    response = await task
    assert response.status == 200 and float(response.headers["x-tokenway-queued-ms"]) > 0
    # the last ask: every check on the walk's route, then every check again on the route the room found
    assert closed.asked[-2:] == ["small/both-s0", "small/both-s1"]
    assert not_first.asked[-2:] == ["small/both-s0", "small/both-s1"]
    assert not_first.went_to == ["small/both-s1"] and walk.router.dispatched == ["small/both-s1"]
    (record,) = walk.records.records
    assert record.endpoint == "small/both-s1" and record.reject_reason == "queued" and record.queue_ms
    assert walk.admission.ends() == {"small-1": ["settle"]} and walk.endpoints_idle()
    await walk.upstream.close()


async def test_no_route_left_is_the_avoiding_check_s_answer(engines: list[str]) -> None:
    gate = room(Closed(open=True), NotOn("small/both-s0"))
    walk = build(fleet({"small": engines[:1]}), gate=gate)
    response = await walk.director.handle(chat_request("small"), "chat")
    assert response.status == 503 and body_json(response)["error"]["code"] == "nowhere"
    assert walk.router.dispatched == [] and gate.queue.depth("small") == 0
    assert walk.admission.ends() == {"small-1": ["release"]}
    await walk.upstream.close()


async def test_a_wait_that_runs_out_is_answered_by_the_check_that_held_it(engines: list[str]) -> None:
    gate = room(Closed(), NotOn("small/both-s0"), max_queue_ms=50)
    walk = build(fleet({"small": engines}), gate=gate)
    response = await walk.director.handle(chat_request("small"), "chat")
    assert response.status == 503 and body_json(response)["error"]["code"] == "closed"
    assert float(response.headers["x-tokenway-queued-ms"]) > 0
    (record,) = walk.records.records
    assert record.reject_reason == "closed" and record.queue_ms
    assert walk.admission.ends() == {"small-1": ["release"]} and gate.queue.depth("small") == 0
    await walk.upstream.close()

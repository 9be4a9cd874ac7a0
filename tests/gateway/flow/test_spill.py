"""Spill-over at the gate, in process: a model's owned pool first, its overflow pool only for what the
owned one cannot take (its room over budget, or down), back home as soon as capacity returns, and
only for tenants whose policy lets them spill (and under their $/day)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Fleet
from backends.types import EndpointState
from gateway.flow.checks import REASON_CROWDED, REASON_NO_ROUTE, REASON_PRICED, REASON_WAITED, Saturation, Spill
from gateway.flow.gate import Check, Gate
from gateway.flow.queue import FlowQueue
from gateway.request import RequestContext
from policies.flow.order import MemoryCounters
from policies.flow.saturation import FlowSettings
from policies.holder import PolicyHolder
from policies.policy import Policy
from policies.schema import PoliciesConfig
from sim.server import run_sim_instances
from tests.gateway.request.walk import Walk, build, chat_request, policy

SETTINGS = FlowSettings.model_validate({"saturation": {"max_engine_waiting": 0, "max_stats_age_s": 3600}})


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    async with run_sim_instances("llama-3.1-8b@h100", 2, time_scale=50.0, served_model_names=["llama-3.1-8b"]) as urls:
        yield urls


def two_pools(owned: str, hosted: str) -> Fleet:
    """Model `small` on an owned pool and on an overflow pool (listed first: overflow still goes last)."""
    configs = [
        PoolConfig(
            name="hosted", model="small", engine="openai", overflow=True, endpoints=[StaticEndpointConfig(url=hosted)]
        ),
        PoolConfig(name="owned", model="small", engine="openai", endpoints=[StaticEndpointConfig(url=owned)]),
    ]
    built = Fleet.from_configs(configs)
    for endpoint in built.endpoints():
        endpoint.state = EndpointState.READY
        endpoint.served_model = "llama-3.1-8b"
    return built


def spill_gate(
    the_fleet: Fleet,
    spill: dict[str, Any] | None = None,
    tenant: dict[str, Any] | None = None,
    max_queue_ms: float | None = None,
) -> Gate:
    doc = policy().config.model_dump(mode="json")
    doc["spill"] = {"max_wait_ms": 20, **(spill or {})}
    doc["tenants"]["t"]["spill"] = tenant or {}
    if max_queue_ms is not None:  # the `normal` band's wait before its 429 (default 10 s)
        doc["flow_control"] = {"bands": {"normal": {"max_queue_ms": max_queue_ms, "on_timeout": 429}}}
    queue = FlowQueue(MemoryCounters(), recheck_s=0.01)
    holder = PolicyHolder(Policy(PoliciesConfig.model_validate(doc)))
    checks: list[Check] = [Spill(queue, holder, the_fleet), Saturation(queue, SETTINGS)]
    return Gate(queue, SETTINGS, holder, checks=checks)


def saturate(walk: Walk, pool: str, waiting: int) -> None:
    """The pool's engine reports `waiting` requests queued inside it (as a fresh scrape would)."""
    for endpoint in walk.fleet.pools[pool].endpoints:
        endpoint.stats.waiting = waiting
        endpoint.stats.scraped_at_s = time.monotonic()


async def served_on(walk: Walk) -> tuple[int, str, str | None]:
    before = len(walk.records.records)
    response = await walk.director.handle(chat_request("small"), "chat")
    record = walk.records.records[before]
    return response.status, record.pool, record.spill


async def test_owned_capacity_first_then_overflow_while_it_is_saturated_then_home_again(engines: list[str]) -> None:
    the_fleet = two_pools(*engines)
    gate = spill_gate(the_fleet)
    walk = build(the_fleet, gate=gate)
    assert [p.name for p in the_fleet.pools_for_model("small")] == ["owned", "hosted"]
    assert await served_on(walk) == (200, "owned", None)
    saturate(walk, "owned", 3)
    assert await served_on(walk) == (200, "hosted", REASON_WAITED)  # waited past max_wait_ms, then spilled
    saturate(walk, "owned", 0)
    assert await served_on(walk) == (200, "owned", None)  # capacity is back: it stays home
    await walk.upstream.close()


async def test_a_crowded_room_spills_arrivals_at_once(engines: list[str]) -> None:
    the_fleet = two_pools(*engines)
    gate = spill_gate(the_fleet, spill={"max_wait_ms": 60_000, "max_waiting": 1})
    walk = build(the_fleet, gate=gate)
    saturate(walk, "owned", 3)
    status, pool, spill = await served_on(walk)
    assert (status, pool) == (200, "hosted") and spill in (REASON_CROWDED, REASON_WAITED)
    await walk.upstream.close()


async def test_a_down_owned_pool_sends_everything_to_the_overflow_pool(engines: list[str]) -> None:
    the_fleet = two_pools(*engines)
    walk = build(the_fleet, gate=spill_gate(the_fleet))
    for endpoint in the_fleet.pools["owned"].endpoints:
        endpoint.state = EndpointState.UNHEALTHY
    assert await served_on(walk) == (200, "hosted", REASON_NO_ROUTE)
    await walk.upstream.close()


async def test_a_tenant_that_may_not_spill_waits_for_owned_capacity(engines: list[str]) -> None:
    the_fleet = two_pools(*engines)
    gate = spill_gate(the_fleet, tenant={"allowed": False})
    walk = build(the_fleet, gate=gate)
    saturate(walk, "owned", 3)
    pending = asyncio.ensure_future(walk.director.handle(chat_request("small"), "chat"))
    await asyncio.sleep(0.1)
    assert not pending.done()  # held: neither spilled nor refused
    saturate(walk, "owned", 0)
    gate.queue.notify("owned")
    response = await pending
    assert response.status == 200 and walk.records.records[-1].pool == "owned"
    await walk.upstream.close()


@pytest.mark.slow
async def test_a_tenant_over_its_spill_cap_stays_home(engines: list[str]) -> None:
    the_fleet = two_pools(*engines)
    gate = spill_gate(the_fleet, tenant={"usd_per_day": 1.0}, max_queue_ms=300)
    spill = gate.checks[0]
    assert isinstance(spill, Spill)
    walk = build(the_fleet, gate=gate)
    for endpoint in the_fleet.pools["owned"].endpoints:
        endpoint.state = EndpointState.UNHEALTHY
    assert await served_on(walk) == (200, "hosted", REASON_NO_ROUTE)
    # what it spent on the overflow pool counts against the cap (the walk's policy prices nothing)
    record = walk.records.records[-1]
    record.cost_usd = 1.5
    spill.finished(cast(RequestContext, SimpleNamespace(record=record)))  # all `finished` reads of it
    assert spill.spent_today("t") == pytest.approx(1.5)
    status, _, _ = await served_on(walk)
    assert status != 200  # over the cap: no overflow, and no owned endpoint up either
    await walk.upstream.close()


def reprice(gate: Gate, usd_per_wait_second: float, hosted_output_per_mtok: float, max_wait_ms: float) -> None:
    """`small` at $1 / $2 per million tokens on its owned pool and its own price on the overflow pool,
    the priced spill policy on (a reload: the next ask reads it)."""
    doc = gate.policies.current.config.model_dump(mode="json")
    doc["models"]["small"]["price"] = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}
    doc["models"]["small"]["pool_prices"] = {
        "hosted": {"input_per_mtok": 3.0, "output_per_mtok": hosted_output_per_mtok}
    }
    doc["spill"] = {"max_wait_ms": max_wait_ms, "usd_per_wait_second": usd_per_wait_second}
    gate.policies.current = Policy(PoliciesConfig.model_validate(doc))


@pytest.mark.slow
async def test_a_wait_worth_more_than_the_overflows_extra_price_spills_before_max_wait(engines: list[str]) -> None:
    """`spill.usd_per_wait_second`: the room's drain rate predicts the wait; valued above the hosted
    pool's extra dollars for the request it spills at once (long before `max_wait_ms`), valued below
    them it waits for the fixed bound."""
    the_fleet = two_pools(*engines)
    gate = spill_gate(the_fleet)
    walk = build(the_fleet, gate=gate)
    reprice(gate, usd_per_wait_second=1.0, hosted_output_per_mtok=15.0, max_wait_ms=60_000)
    # a first request waits its turn (no rate to predict by yet: it does not spill on price) and goes
    # home when capacity frees, which gives the room its drain rate
    saturate(walk, "owned", 3)
    first = asyncio.ensure_future(walk.director.handle(chat_request("small"), "chat"))
    await asyncio.sleep(0.2)
    assert not first.done()
    saturate(walk, "owned", 0)
    gate.queue.notify("owned")
    assert (await first).status == 200 and walk.records.records[-1].pool == "owned"
    saturate(walk, "owned", 3)
    wait_s = gate.queue.predicted_wait_s("owned", 0, held=True)
    assert wait_s is not None and wait_s > 1.0  # about 10 s: one dispatch per 10 s window
    # seconds of waiting at $1/s against a few cents more on the hosted pool: it spills at once
    assert await asyncio.wait_for(served_on(walk), 30) == (200, "hosted", REASON_PRICED)
    # a wait valued at a millionth of a dollar a second is not worth the hosted pool's extra price:
    # it waits for max_wait_ms and spills for that reason instead
    reprice(gate, usd_per_wait_second=1e-6, hosted_output_per_mtok=15.0, max_wait_ms=300)
    assert await served_on(walk) == (200, "hosted", REASON_WAITED)
    await walk.upstream.close()

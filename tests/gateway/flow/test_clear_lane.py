"""Flow control's clear lane at the gate (`reserve_clear_lane`): while the reserve is kept for a light
tenant, the flood's request starts only on an endpoint with no prefill pending, and only while another
endpoint with a free slot stays clear, so the light tenant's next prompt never shares its prefill step
with the flood's; the light tenant's own request goes to the clear endpoint."""

from __future__ import annotations

from collections.abc import Collection
from typing import cast

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Pool
from backends.types import Endpoint, EndpointState
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

NORMAL = band_rank(0)
LANE = {"max_engine_waiting": 0, "reserve_slots": 2, "reserve_clear_lane": True, "max_stats_age_s": 3600}


def endpoint(name: str) -> Endpoint:
    return Endpoint(
        id=f"p/{name}", pool="p", base_url=f"http://{name}", engine="sim", served_model="m", state=EndpointState.READY
    )


def setup(lane: bool = True) -> tuple[Gate, Pool, list[Endpoint]]:
    eps = [endpoint("a"), endpoint("b")]
    config = PoolConfig(
        name="p", model="m", max_num_seqs=8, endpoints=[StaticEndpointConfig(url=e.base_url) for e in eps]
    )
    pool = Pool(config, endpoints=eps)
    settings = FlowSettings.model_validate({"saturation": {**LANE, "reserve_clear_lane": lane}})
    queue = FlowQueue(MemoryCounters())
    holder = PolicyHolder(Policy(PoliciesConfig.model_validate({})))
    hook = Gate(queue, settings, holder, checks=[Saturation(queue, settings)])
    # the flood holds six slots and waits with more; the light tenant is active, nothing of it waiting
    hook.queue.activity.inflight("p", "flood", NORMAL, 1.0, 6)
    hook.queue.activity.waiting("p", "flood", NORMAL, 1.0, 5)
    hook.queue.activity.inflight("p", "light", NORMAL, 1.0, 1)
    eps[0].inflight.requests, eps[1].inflight.requests = 4, 3
    return hook, pool, eps


def ask(hook: Gate, pool: Pool, on: Endpoint, tenant: str) -> Routed | Blocked:
    """The gate's answer (its saturation check's, routing again where it says so) for a request of
    `tenant` routed to `on`."""

    def reroute(more: Collection[str]) -> Routed | None:
        left = [e for e in pool.servable() if e.id not in more]
        return Routed(pool, RouteDecision(left[0], "load")) if left else None

    request = FlowRequest("r", tenant, NORMAL, 400.0, 1.0, float("inf"), 0)
    turn = Turn(cast(RequestContext, None), request, pool.name, 0.0, float("inf"))  # the check reads no context
    return hook._ask(turn, Routed(pool, RouteDecision(on, "load")), reroute)


def test_the_flood_starts_only_where_no_prefill_is_pending_while_another_endpoint_stays_clear() -> None:
    hook, pool, (a, b) = setup()
    opened = ask(hook, pool, a, "flood")
    assert isinstance(opened, Routed) and opened.endpoint is a  # both clear: either leaves the other
    b.inflight.prefill_tokens = 300  # the light tenant's prompt waits for its step on b
    assert ask(hook, pool, a, "flood") is Blocked.TENANT  # a would leave no endpoint clear
    assert ask(hook, pool, b, "flood") is Blocked.TENANT  # nor may it join the light prompt's step
    light = ask(hook, pool, b, "light")
    assert isinstance(light, Routed) and light.endpoint is a  # the light tenant goes where it is clear
    b.inflight.prefill_tokens = 0  # its first token came
    a.inflight.prefill_tokens = 300  # a flood prompt pending on a: the next one waits for it
    assert ask(hook, pool, b, "flood") is Blocked.TENANT


def test_without_the_lane_the_flood_may_take_any_open_endpoint() -> None:
    hook, pool, (_, b) = setup(lane=False)
    b.inflight.prefill_tokens = 300
    opened = ask(hook, pool, b, "flood")
    assert isinstance(opened, Routed) and opened.endpoint is b


def test_a_flood_within_its_share_of_slots_but_over_its_share_of_tokens_is_held_by_the_lane() -> None:
    hook, pool, (a, b) = setup()
    # a light burst holds more than its weighted share of the slots with one request waiting: by the
    # slot count the light tenant is backlogged and the flood within its share ...
    hook.queue.activity.inflight("p", "light", NORMAL, 1.0, 8)
    hook.queue.activity.waiting("p", "light", NORMAL, 1.0, 1)
    b.inflight.prefill_tokens = 300
    now = hook.queue.now()
    hook.queue.share("p").add("flood", 9000.0, now)  # ... but the flood had most of the band's tokens
    hook.queue.share("p").add("light", 1000.0, now)
    assert ask(hook, pool, a, "flood") is Blocked.TENANT
    light = ask(hook, pool, b, "light")
    assert isinstance(light, Routed) and light.endpoint is a

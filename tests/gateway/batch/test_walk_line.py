"""A batch line on the walk, in process: `Director.walk` with the batch transport (`LineTransport`) and
the gate's batch spare-capacity check, with the walk's own invariants (one record, every reservation
ended once, every load ticket ended)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import orjson
import pytest
from aiohttp import web

from gateway.batch.capacity import BatchCapacity, BatchGate
from gateway.batch.lines import LOWEST_PRIORITY, NO_SPARE_CAPACITY, LineRequest, LineTransport, classify, walk_runner
from gateway.flow.gate import Gate, Turn, Verdict
from gateway.flow.queue import FlowQueue
from gateway.request import Routed
from policies.batch import SpareLimits
from policies.flow.order import MemoryCounters
from policies.flow.saturation import FlowSettings
from policies.holder import PolicyHolder
from sim.server import run_sim_instances
from tests.gateway.request.walk import KEY, ScriptedPredictor, Walk, build, chat_request, fleet, policy

LIMITS = SpareLimits(max_lines_per_endpoint=2, max_kv_usage_ratio=None)


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    async with run_sim_instances("llama-3.1-8b@h100", 2, time_scale=50.0, served_model_names=["llama-3.1-8b"]) as urls:
        yield urls


def line(request_id: str = "batch_1-0-x", model: str = "big") -> LineRequest:
    principal = policy().authenticate(KEY)
    assert principal is not None
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "ignore_eos": True}
    return LineRequest("batch_1", 0, "c0", "chat", body, principal, request_id)


def gated(
    urls: list[str], waiting: int = 0, predictor: ScriptedPredictor | None = None, limits: SpareLimits = LIMITS
) -> tuple[Walk, BatchCapacity]:
    the_fleet = fleet({"big": urls})
    capacity = BatchCapacity(the_fleet, limits, waiting=lambda pool: waiting)
    return build(the_fleet, gate=gate_of(BatchGate(capacity, PolicyHolder(policy()), predictor))), capacity


def gate_of(check: BatchGate) -> Gate:
    """The gate with the batch check alone."""
    return Gate(FlowQueue(MemoryCounters()), FlowSettings(), PolicyHolder(policy()), checks=[check])


def assert_invariants(walk: Walk, requests: int) -> None:
    assert all(len(how) == 1 for how in walk.admission.ends().values())
    assert walk.endpoints_idle()
    assert len(walk.records.records) == requests


async def test_a_line_walks_like_a_request_and_its_record_names_the_batch(engines: list[str]) -> None:
    walk, capacity = gated(engines[:1])
    request = line()
    capacity.load.started(request.request_id, "big")
    answer = await walk_runner(walk.director, None)(request)
    assert answer.status == 200 and classify(answer) == "done"
    assert orjson.loads(answer.body)["object"] == "chat.completion"
    (record,) = walk.records.records
    assert (record.request_id, record.batch_id, record.status, record.key_id) == (
        request.request_id,
        "batch_1",
        "ok",
        "k",
    )
    assert record.slo_class is None  # a batch line has no latency objective
    assert walk.admission.ends() == {"big-1": ["settle"]}
    capacity.load.finished(request.request_id)
    assert capacity.load.lines == 0 and not capacity.load.by_endpoint
    assert_invariants(walk, 1)
    await walk.upstream.close()


async def test_the_line_runs_at_the_lowest_priority(engines: list[str]) -> None:
    seen: list[int] = []

    class Spy(BatchGate):
        def check(self, turn: Turn, routed: Routed) -> Verdict:
            ctx = turn.ctx
            seen.append(ctx.facts.principal.priority)
            assert ctx.facts.batch_id == "batch_1" and ctx.http is None
            return super().check(turn, routed)

    the_fleet = fleet({"big": engines[:1]})
    walk = build(the_fleet, gate=gate_of(Spy(BatchCapacity(the_fleet, LIMITS), PolicyHolder(policy()))))
    assert (await walk_runner(walk.director, None)(line())).status == 200
    assert seen == [LOWEST_PRIORITY]
    await walk.upstream.close()


async def test_no_spare_capacity_is_a_503_the_runner_reads_as_later(engines: list[str]) -> None:
    walk, _capacity = gated(engines[:1], waiting=1)  # an interactive request waits for the pool
    answer = await walk_runner(walk.director, None)(line())
    assert answer.status == 503 and answer.code == NO_SPARE_CAPACITY and classify(answer) == "later"
    (record,) = walk.records.records
    assert (record.status, record.reject_reason) == ("rejected", NO_SPARE_CAPACITY)
    assert walk.admission.ends() == {"big-1": ["release"]}  # nothing was sent: nothing is charged
    assert_invariants(walk, 1)
    response = await walk.director.handle(chat_request(), "chat")  # interactive requests never meet the gate
    assert isinstance(response, web.Response) and response.status == 200
    await walk.upstream.close()


async def test_a_full_endpoint_sends_the_line_to_another(engines: list[str]) -> None:
    walk, capacity = gated(engines)
    capacity.load.by_endpoint["big/both-s0"] = LIMITS.max_lines_per_endpoint  # the first is at its batch cap
    answer = await walk_runner(walk.director, None)(line())
    assert answer.status == 200
    assert walk.records.records[0].endpoint == "big/both-s1"
    capacity.load.by_endpoint["big/both-s1"] = LIMITS.max_lines_per_endpoint
    refused = await walk_runner(walk.director, None)(line("batch_1-1-y"))
    assert refused.status == 503 and refused.code == NO_SPARE_CAPACITY
    assert_invariants(walk, 2)
    await walk.upstream.close()


async def test_a_busy_prediction_keeps_the_line_away(engines: list[str]) -> None:
    busy, capacity = gated(engines[:1], predictor=ScriptedPredictor(60.0))  # over half of the 100 ms objective
    (endpoint,) = capacity.fleet.pools["big"].servable()
    endpoint.inflight.requests += 1  # an interactive request runs there
    answer = await walk_runner(busy.director, None)(line())
    assert answer.status == 503 and answer.code == NO_SPARE_CAPACITY
    quick, capacity = gated(engines[:1], predictor=ScriptedPredictor(20.0))
    (endpoint,) = capacity.fleet.pools["big"].servable()
    endpoint.inflight.requests += 1
    assert (await walk_runner(quick.director, None)(line())).status == 200
    endpoint.inflight.requests -= 1
    await busy.upstream.close()
    await quick.upstream.close()


async def test_a_long_line_runs_on_an_idle_endpoint(engines: list[str]) -> None:
    """Its own predicted TTFT over the headroom, but nothing else runs there: it goes (refused, a
    batch of long prompts never finished even on an idle fleet)."""
    idle, _ = gated(engines[:1], predictor=ScriptedPredictor(60.0))
    assert (await walk_runner(idle.director, None)(line())).status == 200
    await idle.upstream.close()


async def test_a_line_waits_for_the_batch_prefill_ahead_of_it(engines: list[str]) -> None:
    """`paced_starts`: an endpoint where a batch line is still within its predicted prefill takes no
    other (it is sent elsewhere, or refused); the answer of that line ends its prefill at once."""
    paced = replace(LIMITS, paced_starts=True)
    one, capacity = gated(engines[:1], predictor=ScriptedPredictor(20.0), limits=paced)
    (endpoint,) = capacity.fleet.pools["big"].servable()
    capacity.load.started("batch_1-9-ahead", "big")
    capacity.load.placed("batch_1-9-ahead", endpoint.id, capacity.now() + 3600)
    refused = await walk_runner(one.director, None)(line())
    assert refused.status == 503 and refused.code == NO_SPARE_CAPACITY
    capacity.load.finished("batch_1-9-ahead")  # answered: no longer prefilling
    assert not capacity.load.prefilling(endpoint.id, capacity.now())
    assert (await walk_runner(one.director, None)(line("batch_1-1-y"))).status == 200
    await one.upstream.close()

    two, capacity = gated(engines, predictor=ScriptedPredictor(20.0), limits=paced)
    capacity.load.started("batch_1-9-ahead", "big")
    capacity.load.placed("batch_1-9-ahead", "big/both-s0", capacity.now() + 3600)
    answer = await walk_runner(two.director, None)(line())
    assert answer.status == 200 and two.records.records[0].endpoint == "big/both-s1"
    assert_invariants(two, 1)
    await two.upstream.close()


async def test_the_line_transport_answers_a_refusal_in_process_with_its_code() -> None:
    walk = build(fleet({"big": ["http://10.0.0.1:8000"]}))  # never reached: the model is refused first
    transport = LineTransport(walk.director.transport)
    assert not transport.follows
    answer = await walk_runner(walk.director, None)(line(model="no-such-model"))
    assert (answer.status, answer.code) == (404, "model_not_found")  # the line's final answer: an error line
    assert answer.headers["x-request-id"] == "batch_1-0-x"
    (record,) = walk.records.records
    assert (record.status, record.batch_id) == ("rejected", "batch_1")
    assert walk.admission.ends() == {}  # refused before admission: nothing reserved

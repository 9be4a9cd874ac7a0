"""The walk's invariants, in process: every admitted reservation settled or released exactly once,
every endpoint load ticket ended, exactly one record per request — when served, when the engine
refuses, when a retry or a fallback serves, when the SLO gate rejects or a request it holds in flow
control's queue times out, and when the client goes away at any await of any of those."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import orjson
import pytest
from aiohttp import web

from gateway.flow.checks import SloHook
from gateway.flow.gate import Gate
from gateway.request import Hook
from policies.types import Rejection
from sim.server import run_sim_instances
from tests.gateway.request.walk import (
    QUEUE_KEY,
    SLO_KEY,
    RecordingAdmission,
    ScriptedPredictor,
    Walk,
    body_json,
    build,
    chat_request,
    fleet,
    handle_cancelled_at,
    slo_gate,
)
from tests.support.procs import free_port

RATE_LIMITED = Rejection(429, "Rate limit reached.", "tokens", "rate_limit_exceeded", reason="rate_limited")


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    async with run_sim_instances("llama-3.1-8b@h100", 2, time_scale=50.0, served_model_names=["llama-3.1-8b"]) as urls:
        yield urls


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused


def assert_invariants(walk: Walk, requests: int) -> None:
    ends = walk.admission.ends()
    assert all(len(how) == 1 for how in ends.values()), ends  # settled or released, exactly once
    assert walk.endpoints_idle()  # every load ticket ended
    assert len(walk.records.records) == requests  # exactly one record each


async def test_served_unary(engines: list[str]) -> None:
    walk = build(fleet({"big": engines[:1]}))
    response = await walk.director.handle(chat_request(), "chat")
    assert isinstance(response, web.Response) and response.status == 200
    assert response.headers["x-tokenway-model"] == "big" and response.headers["x-ratelimit-limit-requests"] == "100"
    assert walk.admission.ends() == {"big-1": ["settle"]}
    (record,) = walk.records.records
    assert (record.status, record.http_status, record.model, record.completion_tokens) == ("ok", 200, "big", 3)
    assert record.usage_source == "engine" and record.engine_metrics is not None
    assert_invariants(walk, 1)
    await walk.upstream.close()


async def test_served_stream(engines: list[str]) -> None:
    walk = build(fleet({"big": engines[:1]}))
    response = await walk.director.handle(chat_request(stream=True), "chat")
    assert response.status == 200 and response.prepared
    (record,) = walk.records.records
    assert record.status == "ok" and record.stream and record.ttft_s is not None and record.completion_tokens == 3
    assert walk.admission.ends() == {"big-1": ["settle"]}
    assert_invariants(walk, 1)
    await walk.upstream.close()


async def test_engine_4xx_is_passed_on_and_charges_nothing(engines: list[str]) -> None:
    walk = build(fleet({"big": engines[:1]}, engine_model="not-served-there"))
    response = await walk.director.handle(chat_request(), "chat")
    assert isinstance(response, web.Response) and response.status == 404
    assert response.body is not None
    error = orjson.loads(response.body)["error"]  # type: ignore[arg-type]
    assert "does not exist" in error["message"]
    (record,) = walk.records.records
    assert (record.status, record.http_status, record.upstream_attempts) == ("error", 404, 1)
    assert walk.admission.ends() == {"big-1": ["settle"]}  # the request counts, its tokens do not
    assert_invariants(walk, 1)
    await walk.upstream.close()


async def test_retry_on_another_endpoint_before_the_first_byte(engines: list[str]) -> None:
    walk = build(fleet({"big": [dead_url(), engines[0]]}))
    response = await walk.director.handle(chat_request(), "chat")
    assert response.status == 200
    (record,) = walk.records.records
    assert record.upstream_attempts == 2 and record.endpoint == "big/both-s1"
    assert walk.router.dispatched == ["big/both-s0", "big/both-s1"]
    assert walk.admission.ends() == {"big-1": ["settle"]}
    assert_invariants(walk, 1)
    await walk.upstream.close()


async def test_upstream_failure_falls_back_to_the_next_model(engines: list[str]) -> None:
    walk = build(fleet({"big": [dead_url()], "small": engines[:1]}), retries=0)
    response = await walk.director.handle(chat_request(), "chat")
    assert response.status == 200 and response.headers["x-tokenway-fallback"] == "big->small;reason=upstream_error"
    (record,) = walk.records.records
    assert (record.model, record.fallback_from, record.fallback_reason) == ("small", "big", "upstream_error")
    assert walk.admission.ends() == {"big-1": ["release"], "small-2": ["settle"]}
    assert_invariants(walk, 1)
    await walk.upstream.close()


async def test_rate_limited_falls_back_and_without_a_fallback_is_a_429(engines: list[str]) -> None:
    walk = build(fleet({"big": engines[:1], "small": engines[1:]}), admission=RecordingAdmission({"big": RATE_LIMITED}))
    response = await walk.director.handle(chat_request(), "chat")
    assert response.status == 200 and walk.records.records[0].model == "small"
    walk.admission.reject["small"] = RATE_LIMITED
    refused = await walk.director.handle(chat_request(), "chat")
    assert refused.status == 429
    record = walk.records.records[1]
    assert (record.status, record.reject_reason, record.http_status) == ("rejected", "rate_limited", 429)
    assert_invariants(walk, 2)
    await walk.upstream.close()


async def test_no_healthy_endpoint_is_a_503(engines: list[str]) -> None:
    the_fleet = fleet({"small": engines[:1]})
    for endpoint in the_fleet.endpoints():
        endpoint.state = endpoint.state.UNHEALTHY
    walk = build(the_fleet)
    response = await walk.director.handle(chat_request("small"), "chat")
    assert response.status == 503 and response.headers["retry-after"] == "1"
    assert walk.records.records[0].error_code == "no_healthy_backend"
    assert walk.admission.ends() == {"small-1": ["release"]}
    assert_invariants(walk, 1)


async def test_slo_miss_rejects_with_a_503_and_releases(engines: list[str]) -> None:
    walk = build(fleet({"small": engines[:1]}), gate=slo_gate(ScriptedPredictor(5000.0))[1])
    response = await walk.director.handle(chat_request("small", key=SLO_KEY), "chat")
    assert response.status == 503 and "retry-after" in response.headers
    (record,) = walk.records.records
    assert (record.status, record.reject_reason, record.slo_class) == ("rejected", "slo_unattainable", "strict")
    assert walk.admission.ends() == {"small-1": ["release"]} and walk.router.dispatched == []
    assert_invariants(walk, 1)


async def test_slo_miss_falls_back_where_the_chain_allows(engines: list[str]) -> None:
    walk = build(fleet({"big": engines[:1], "small": engines[1:]}), gate=slo_gate(ScriptedPredictor(5000.0, 1.0))[1])
    response = await walk.director.handle(chat_request("big", key=SLO_KEY), "chat")
    # strict says reject, not fall back: the chain is not walked
    assert response.status == 503
    assert walk.admission.ends() == {"big-1": ["release"]}
    assert_invariants(walk, 1)
    await walk.upstream.close()


async def test_slo_queue_serves_once_an_endpoint_meets_it(engines: list[str]) -> None:
    _slo, flow = slo_gate(ScriptedPredictor(9000.0, 9000.0, 10.0))
    walk = build(fleet({"small": engines[:1]}), gate=flow)
    response = await walk.director.handle(chat_request("small", key=QUEUE_KEY), "chat")
    assert response.status == 200 and float(response.headers["x-tokenway-queued-ms"]) > 0
    (record,) = walk.records.records
    assert record.reject_reason == "queued" and record.queue_ms is not None and record.queue_ms > 0
    assert walk.admission.ends() == {"small-1": ["settle"]}
    assert flow.queue.depth("small") == 0
    assert_invariants(walk, 1)
    await walk.upstream.close()


@pytest.mark.slow
async def test_slo_queue_times_out_with_a_503(engines: list[str]) -> None:
    _slo, flow = slo_gate(ScriptedPredictor(9000.0))
    walk = build(fleet({"small": engines[:1]}), gate=flow)
    response = await walk.director.handle(chat_request("small", key=QUEUE_KEY), "chat")
    assert response.status == 503 and float(response.headers["x-tokenway-queued-ms"]) > 0
    assert body_json(response)["error"]["code"] == "slo_unattainable"
    (record,) = walk.records.records
    assert record.reject_reason == "queue_timeout" and record.queue_ms is not None
    assert walk.admission.ends() == {"small-1": ["release"]} and flow.queue.depth("small") == 0
    assert_invariants(walk, 1)


class Phases(Hook):
    """Counts each phase, to check the walk calls `ended` once after every `dispatched`."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, phase: str) -> None:
        self.calls[phase] = self.calls.get(phase, 0) + 1

    def dispatched(self, ctx: object) -> None:
        self._count("dispatched")

    def ended(self, ctx: object) -> None:
        self._count("ended")

    def finished(self, ctx: object) -> None:
        self._count("finished")


Scenario = Callable[[list[str]], tuple[Walk, Callable[[], web.Request]]]


def _stream(engines: list[str]) -> tuple[Walk, Callable[[], web.Request]]:
    return build(fleet({"big": engines[:1]}), hooks=[Phases()]), lambda: chat_request(stream=True)


def _unary_after_retry(engines: list[str]) -> tuple[Walk, Callable[[], web.Request]]:
    return build(fleet({"big": [dead_url(), engines[0]]}), hooks=[Phases()]), chat_request


def _fallback(engines: list[str]) -> tuple[Walk, Callable[[], web.Request]]:
    walk = build(
        fleet({"big": engines[:1], "small": engines[1:]}),
        admission=RecordingAdmission({"big": RATE_LIMITED}),
        hooks=[Phases()],
    )
    return walk, lambda: chat_request(stream=True)


def _queued(engines: list[str]) -> tuple[Walk, Callable[[], web.Request]]:
    _slo, flow = slo_gate(ScriptedPredictor(9000.0, 10.0))
    return build(fleet({"small": engines[:1]}), hooks=[Phases()], gate=flow), lambda: chat_request(
        "small", key=QUEUE_KEY, stream=True
    )


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param(_stream, id="stream"),
        pytest.param(_unary_after_retry, id="retry"),
        pytest.param(_fallback, id="fallback"),
        pytest.param(_queued, id="slo-queue"),
    ],
)
async def test_client_abort_at_every_await_leaves_nothing_open(engines: list[str], scenario: Scenario) -> None:
    walk, make_request = scenario(engines)
    at = 0
    completed = False
    while at < 2000 and not completed:
        cancelled, _ = await handle_cancelled_at(walk, make_request, at)
        completed = not cancelled
        assert_invariants(walk, at + 1)
        record = walk.records.records[-1]
        if cancelled and record.status == "ok":  # cancelled after its [DONE] went out: served, and whole
            assert record.stream and record.usage_source == "engine", (at, record)
        else:
            assert record.status == ("aborted" if cancelled else "ok"), (at, record)
        at += 1
    assert completed and at > 3  # every suspension of a whole request was a cancellation point once
    phases = next(h for h in walk.director.hooks.all if isinstance(h, Phases)).calls
    assert phases.get("dispatched", 0) == phases.get("ended", 0) and phases["finished"] == at
    for hook in walk.director.hooks.all:
        if isinstance(hook, SloHook):
            assert not hook.running.floors
        if isinstance(hook, Gate):
            assert hook.queue.depth("small") == 0
            # no lease left open: nothing counts as in flight for any tenant
            assert all(seen.inflight == 0 for seen in hook.queue.activity.active("small").values())
    await walk.upstream.close()

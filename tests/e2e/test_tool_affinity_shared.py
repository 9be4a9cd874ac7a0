"""Tool-boundary affinity across gateway replicas (`state: redis`): a program whose tool-call answer
one gateway served goes back to the same engine replica when its next turn reaches the other
gateway (docs/agents.md#tool-boundary-affinity).

Real processes: three simulated engines, two `tokenway serve` sharing one real Redis (the replicas'
stream carries the notes), the official `openai` client talking to each gateway directly. Where a
turn went is read from `x-tokenway-endpoint`, why from the debug header `x-tokenway-route`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import orjson
import pytest
import redis

from policies.routing.config import PipelineConfig
from tests.e2e.test_tool_affinity import TOOL, _next_messages, _system, _turn
from tests.support.polling import wait_for
from tests.support.procs import Gateway, http_get, running, start_gateway, start_sim, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[list[Gateway]]:
    workdir = tmp_path_factory.mktemp("tool-affinity-shared")
    prefix = f"tokenway-test:{uuid.uuid4().hex[:12]}"
    engines = start_sim(workdir, count=3, served_model_name=MODEL)
    pipeline = PipelineConfig().model_dump()
    pipeline["scorers"].append({"type": "tool-affinity", "weight": 2.0, "params": {}})

    def start(i: int) -> Gateway:
        return start_gateway(
            workdir / f"gw{i}",
            pools=[static_pool("agents", MODEL, engines.urls)],
            routing={"default": pipeline},
            state={"backend": "redis", "redis_url": redis_url, "key_prefix": prefix, "replicas": {"id": f"gw{i}"}},
            predictor={"enabled": False},
        )

    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(start, range(2)))
    try:
        with running(engines, *started):
            yield started
    finally:
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)


def _replicas(gateway: Gateway) -> Any:
    status, text = http_get(gateway.url + "/admin/replicas")
    assert status == 200, text
    return orjson.loads(text)


def _heard(gateway: Gateway, counter: str, at_least: int) -> bool:
    return int(_replicas(gateway)[counter]) >= at_least


def test_a_programs_next_turn_on_the_other_gateway_returns_to_its_tool_call_replica(
    gateways: list[Gateway],
) -> None:
    first_gw, other_gw = gateways
    for n in range(3):  # three programs, so that landing on the holder by chance is not what passes
        program = f"agent-{n}-{uuid.uuid4().hex[:8]}"
        first = [{"role": "system", "content": _system(program)}, {"role": "user", "content": "Where is my order?"}]
        applied = int(_replicas(other_gw)["tool_notes_applied"])
        holder, _, answer = _turn(first_gw, program, first, tools=[TOOL], tool_choice="required")
        assert answer.choices[0].finish_reason == "tool_calls"
        wait_for(partial(_heard, other_gw, "tool_notes_applied", applied + 1), what="the other gateway hearing of it")
        endpoint, route, _ = _turn(other_gw, program, _next_messages(first, answer), tools=[TOOL])
        assert endpoint == holder
        assert "reason=tool-return" in route
        # the return ends the entry on the gateway that noted it too, and teaches it the gap
        wait_for(partial(_heard, first_gw, "tool_gaps_applied", n + 1), what="the first gateway hearing of the return")
        _, route, _ = _turn(
            first_gw, program, [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]
        )
        assert "reason=tool-return" not in route

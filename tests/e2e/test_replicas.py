"""Three gateway replicas that act as one, behind a real L4 balancer.

Real processes: three simulated engines, three `tokenway serve` sharing one real Redis
(`state: redis`: limits and the replicas' stream), Debian's haproxy in TCP round-robin mode in
front, the official `openai` client opening a new connection per request (round robin is per
connection), so consecutive requests land on different replicas.

- a conversation's turns land on the engine holding its prefix whichever replica receives them;
- every replica's view of each engine's in-flight requests agrees with the others' and with the
  truth once the reports have gone round;
- a replica killed mid-load loses only its own streams, and its load ages out of the others' views.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai
import orjson
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from tests.support.haproxy import Balancer, start_haproxy
from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, SimEngines, http_get, running, start_gateway, start_sim, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

MODEL = "llama-3.1-8b"
REPLICAS = 3
TTL_S = 1.5
STREAM_TOKENS = 8000  # several seconds of decode at time scale 10: long enough to kill a replica mid-stream


@dataclass
class World:
    engines: SimEngines
    gateways: list[Gateway]
    balancer: Balancer
    sent: int = 0  # requests sent through the balancer so far (each one dispatch)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("replicas")
    prefix = f"tokenway-test:{uuid.uuid4().hex[:12]}"
    engines = start_sim(workdir, count=3, served_model_name=MODEL)

    def start(i: int) -> Gateway:
        return start_gateway(
            workdir / f"gw{i}",
            pools=[static_pool("shared", MODEL, engines.urls)],
            state={
                "backend": "redis",
                "redis_url": redis_url,
                "key_prefix": prefix,
                "replicas": {"id": f"gw{i}", "advanced": {"ttl_s": TTL_S, "heartbeat_s": 0.3}},
            },
            predictor={"enabled": False},  # not under test; a SIGKILLed gateway's worker would linger
        )

    with ThreadPoolExecutor(REPLICAS) as pool:  # start together: each waits for its own readiness
        gateways = list(pool.map(start, range(REPLICAS)))
    balancer = start_haproxy(workdir / "lb", [g.port for g in gateways])
    try:
        with running(engines, *gateways, balancer):
            yield World(engines, gateways, balancer)
    finally:
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)


def _json(url: str) -> Any:
    status, text = http_get(url)
    assert status == 200, text
    return orjson.loads(text)


def _client(world: World) -> openai.OpenAI:
    """A new client: a new connection, so the balancer hands it to the next replica."""
    return openai.OpenAI(base_url=world.balancer.base_url, api_key=TEST_KEY, max_retries=0, timeout=120)


def _everyone_knows(world: World, alive: list[Gateway] | None = None) -> None:
    """Wait until every replica has folded in every dispatch made so far (its own or a peer's)."""

    def known(gateway: Gateway) -> int:
        status = _json(gateway.url + "/admin/replicas")
        return int(status["dispatches_published"]) + int(status["dispatches_applied"])

    gateways = alive or world.gateways
    wait_for(lambda: all(known(g) >= world.sent for g in gateways), what="replicas folding every dispatch")


def _inflight(gateway: Gateway) -> dict[str, int]:
    status = _json(gateway.url + "/admin/backends")
    return {e["id"]: int(e["inflight_requests"]) for p in status["pools"] for e in p["endpoints"]}


def test_conversation_turns_land_on_the_prefix_holder_whichever_replica_serves(world: World) -> None:
    for conversation in range(3):
        system = " ".join(f"{uuid.uuid4().hex[:6]}-{i}" for i in range(400))  # ~1,600 tokens, unique
        history: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}]
        turns: list[tuple[str, str, int]] = []
        for turn in range(4):
            history.append({"role": "user", "content": f"Question {turn} of conversation {conversation}?"})
            raw = _client(world).chat.completions.with_raw_response.create(model=MODEL, messages=history, max_tokens=8)
            world.sent += 1
            completion = raw.parse()
            details = completion.usage.prompt_tokens_details if completion.usage else None
            cached = int(details.cached_tokens or 0) if details is not None else 0
            turns.append((raw.headers["x-tokenway-replica"], raw.headers["x-tokenway-endpoint"], cached))
            history.append({"role": "assistant", "content": completion.choices[0].message.content or ""})
            _everyone_knows(world)
        replicas = {t[0] for t in turns}
        endpoints = {t[1] for t in turns}
        assert len(replicas) >= 2, f"the balancer did not spread the turns: {turns}"
        assert len(endpoints) == 1, f"turns left the engine holding their prefix: {turns}"
        assert all(cached > 0 for _, _, cached in turns[1:]), f"later turns missed the engine's cache: {turns}"


@dataclass
class Stream:
    replica: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    finished_s: float | None = None  # monotonic time the stream ended (either way)


def _stream(world: World, max_tokens: int) -> tuple[threading.Thread, Stream]:
    result = Stream()

    def run() -> None:
        try:
            raw = _client(world).chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"a long answer {uuid.uuid4().hex}"}],
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            result.replica = raw.headers.get("x-tokenway-replica")
            for chunk in raw.parse():
                if chunk.usage is not None:
                    result.completion_tokens = chunk.usage.completion_tokens
        except Exception as exc:  # a stream through the killed replica breaks: that is the point
            result.error = f"{type(exc).__name__}: {exc}"
        result.finished_s = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_inflight_views_agree_and_a_killed_replica_loses_only_its_streams(world: World) -> None:
    streams = [_stream(world, max_tokens=STREAM_TOKENS) for _ in range(12)]
    world.sent += len(streams)
    wait_for(lambda: all(r.replica is not None for _, r in streams), what="every stream started")
    # every replica sees all 12 in flight, spread over the engines the same way
    wait_for(
        lambda: all(sum(_inflight(g).values()) == len(streams) for g in world.gateways),
        what="every replica counting all 12 streams",
    )
    views = [_inflight(g) for g in world.gateways]
    for endpoint_id in views[0]:
        counts = [v[endpoint_id] for v in views]
        assert max(counts) - min(counts) <= 1, f"{endpoint_id}: replicas disagree: {counts}"
    served_by = {r.replica for _, r in streams}
    assert served_by == {"gw0", "gw1", "gw2"}

    victim = world.gateways[1]
    killed_s = time.monotonic()
    victim.stop(signal.SIGKILL)
    for thread, _ in streams:
        thread.join(180)
    survivors = [g for g in world.gateways if g is not victim]
    cut = [r for _, r in streams if r.replica == "gw1" and (r.finished_s or 0) > killed_s]
    assert cut, "no stream was still running through the killed replica: streams too short for this host"
    for _, result in streams:
        if any(result is c for c in cut):
            assert result.completion_tokens is None, "a stream through the killed replica cannot have finished"
        elif result.replica != "gw1":
            assert result.error is None and result.completion_tokens == STREAM_TOKENS, result
    # the dead replica's load leaves the survivors' views (TTL), theirs returns to zero
    wait_for(
        lambda: all(sum(_inflight(g).values()) == 0 for g in survivors),
        timeout_s=60,
        what="the killed replica's streams ageing out",
    )
    for gateway in survivors:
        assert "gw1" not in _json(gateway.url + "/admin/replicas")["peers"]
    # and the fleet goes on serving through the balancer
    for _ in range(4):
        raw = _client(world).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=4
        )
        assert raw.headers["x-tokenway-replica"] in {"gw0", "gw2"}

"""The benchmarks' load generator against the simulated engine, in process: what it records per
request (tokens, first token, the engine's timings, errors in the server's shape) and the open
loop's promise (nothing is sent before its time, every request is waited for)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from bench import loadgen
from sim.server import run_sim_instances

MODEL = "llama-3.1-8b"


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    async with run_sim_instances("llama-3.1-8b@h100", 1, time_scale=50.0, served_model_names=[MODEL]) as urls:
        yield urls[0]


def shot(at_s: float, tokens: int, *, model: str = MODEL, prompt: str = "The quick brown fox") -> loadgen.Shot:
    return loadgen.Shot(at_s, loadgen.completion_body(model, prompt, tokens), loadgen.bearer("none"))


async def test_replay_records_what_the_client_and_engine_saw(engine: str) -> None:
    shots = [shot(0.0, 5), shot(0.02, 1), shot(0.04, 12)]
    outcomes = await loadgen.replay(engine, shots, label="test")
    assert [o.index for o in outcomes] == [0, 1, 2]
    assert all(o.ok and o.status == 200 and o.code == "" for o in outcomes)
    assert [o.completion_tokens for o in outcomes] == [5, 1, 12]  # ignore_eos: exactly max_tokens
    assert all(o.prompt_tokens > 0 for o in outcomes)
    for o in outcomes:
        assert o.ttft_s is not None and 0 < o.ttft_s <= o.e2e_s
        assert o.engine["ttft_s"] > 0 and "queue_s" in o.engine  # the simulated engine's own timings
    assert outcomes[1].tpot_s is None  # one token: no inter-token time
    assert all(o.tpot_s is not None and 0 <= o.tpot_s < o.e2e_s for o in (outcomes[0], outcomes[2]))
    assert [o.scheduled_s for o in outcomes] == [0.0, 0.02, 0.04]


async def test_an_error_answer_keeps_the_servers_code(engine: str) -> None:
    (out,) = await loadgen.replay(engine, [shot(0.0, 4, model="no-such-model")])
    assert not out.ok and out.status == 404 and out.code == "404"  # the engine's (vLLM's) error shape
    assert "no-such-model" in out.message
    assert out.ttft_s is None and out.completion_tokens == 0


async def test_a_refused_connection_is_an_outcome_not_an_exception() -> None:
    from tests.support.procs import free_port

    (out,) = await loadgen.replay(f"http://127.0.0.1:{free_port()}", [shot(0.0, 4)])
    assert not out.ok and out.status == 0 and out.code.startswith("Client")


async def test_open_loop_never_sends_early_and_waits_for_every_request() -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    started: dict[int, float] = {}
    finished: list[int] = []
    last_started = asyncio.Event()

    async def start(i: int) -> None:
        started[i] = loop.time() - t0
        if i == 3:
            last_started.set()
        else:
            await last_started.wait()  # answers come only once the last one was sent: open, not closed
        finished.append(i)

    arrivals = [0.0, 0.01, 0.02, 0.03]
    late = await asyncio.wait_for(loadgen.open_loop(arrivals, start), timeout=60)
    assert sorted(finished) == [0, 1, 2, 3] and len(late) == 4
    assert all(started[i] >= at for i, at in enumerate(arrivals))  # never before its time
    assert all(lag >= 0 for lag in late)


async def test_closed_loop_serves_every_shot(engine: str) -> None:
    outcomes = await loadgen.closed_loop(engine, [shot(0.0, 3) for _ in range(6)], 2)
    assert all(o.ok and o.completion_tokens == 3 for o in outcomes)


def test_a_plan_file_round_trips(tmp_path: Path) -> None:
    shots = [shot(0.5, 3), loadgen.Shot(1.0, b'{"a":1}', {"x": "y"})]
    loadgen.write_plan(tmp_path / "plan.json", "http://h:1", shots, label="L", timeout_s=9.0)
    url, back, label, timeout_s = loadgen.read_plan(tmp_path / "plan.json")
    assert (url, label, timeout_s) == ("http://h:1", "L", 9.0)
    assert [(s.at_s, orjson.loads(s.body), s.headers) for s in back] == [
        (s.at_s, orjson.loads(s.body), s.headers) for s in shots
    ]


def test_prediction_header() -> None:
    values, source = loadgen.parse_prediction("ttft=12.5;ttft_p90=20;tpot=8;tpot_p90=9.5;source=model")
    assert values == {"ttft": 12.5, "ttft_p90": 20.0, "tpot": 8.0, "tpot_p90": 9.5} and source == "model"
    assert loadgen.parse_prediction(None) == ({}, "")


async def test_a_chat_completion_keeps_ttft_finish_usage_and_the_engines_timings(engine: str) -> None:
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 6,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    missing = orjson.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    async with aiohttp.ClientSession() as session:
        call = await loadgen.chat_completion(session, engine, body, loadgen.bearer("none"), 60.0)
        refused = await loadgen.chat_completion(session, engine, missing, loadgen.bearer("none"), 60.0)
    seen = call.stream
    assert call.status == 200 and call.code == "" and call.e2e_s > 0
    assert not seen.error and seen.ttft_s is not None and 0 < seen.ttft_s <= call.e2e_s and seen.finish == "length"
    assert seen.usage["completion_tokens"] == 6 and seen.metrics["ttft_s"] > 0
    assert refused.status == 404 and refused.code == "404" and refused.stream.ttft_s is None


async def test_a_chat_completion_to_nowhere_is_an_outcome_not_an_exception() -> None:
    from tests.support.procs import free_port

    async with aiohttp.ClientSession() as session:
        call = await loadgen.chat_completion(session, f"http://127.0.0.1:{free_port()}", b"{}", {}, 60.0)
    assert call.status == 0 and call.code.startswith("client_error:")

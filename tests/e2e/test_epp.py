"""`tokenway epp` end to end: a gRPC client playing Envoy's side of the endpoint-picker protocol
(tests/support/envoy_side.py: ext_proc in FULL_DUPLEX_STREAMED mode, and the router that sends the
request where the picker said) against `tokenway epp` and real simulated engines.

What a Gateway API Inference Extension gateway relies on: the pick comes as the header and the
dynamic metadata, with the same value; the body Envoy sends on carries the engine's model name and
asks for usage; the response is followed (usage read, the usage chunk the client did not ask for
dropped, the public model name restored); refusals are immediate responses in OpenAI's error shape
with the protocol's statuses (401/404/429/503); the data plane's subset hint is obeyed; a stream cut
by the client settles its reservation exactly once; the gRPC health services answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.envoy_side import Answer, EnvoySide, Picker, envoy_pair, running_picker
from tests.support.polling import wait_for_async
from tests.support.procs import (
    OTHER_KEY,
    TEST_KEY,
    http_get,
    metric_total,
    policies_doc,
    start_sim,
    static_pool,
)

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
PATH = "/v1/chat/completions"
EnvoyPair = tuple[EnvoySide, aiohttp.ClientSession]


@pytest.fixture(scope="module")
def picker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    workdir = tmp_path_factory.mktemp("epp")
    engines = start_sim(workdir, count=2, served_model_name="engine-llama")
    policies = policies_doc(limits=[{"scope": "key", "match": {"key": "k2"}, "rpm": 1}])
    pool = static_pool("pool", MODEL, engines.urls, served_model_name="engine-llama")
    with running_picker(workdir, engines, pools=[pool], policies=policies) as picker:
        yield picker


@pytest.fixture
async def envoy(picker: Picker) -> AsyncIterator[EnvoyPair]:
    async with envoy_pair(picker) as pair:
        yield pair


def chat(content: str, **extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], **extra})


def auth(key: str = TEST_KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


def events(answer: Answer) -> list[dict[str, Any]]:
    return [json.loads(block[6:]) for block in answer.body.split(b"\n\n") if block.startswith(b"data: {")]


def _leases_active(picker: Picker) -> float:
    status, text = http_get(picker.gateway.url + "/admin/status")
    assert status == 200, text
    return float(sum(row.get("active", 0) for row in json.loads(text)["limits"] if row.get("kind") == "lease"))


def _inflight(picker: Picker) -> int:
    _, text = http_get(picker.gateway.url + "/admin/backends")
    return sum(e["inflight_requests"] for p in json.loads(text)["pools"] for e in p["endpoints"])


async def test_a_stream_is_picked_and_followed(picker: Picker, envoy: EnvoyPair) -> None:
    side, session = envoy
    answer = await side.request(PATH, auth(), chat("hello there", max_tokens=12, stream=True), session=session)
    assert answer.status == 200
    assert answer.endpoint in picker.hosts and answer.metadata_endpoint == answer.endpoint  # header = metadata
    forwarded = json.loads(answer.forwarded_body)
    assert forwarded["model"] == "engine-llama"  # the engine's name, not the public one
    assert forwarded["stream_options"] == {"include_usage": True}
    chunks = events(answer)
    assert chunks and all(c["model"] == MODEL for c in chunks)  # the public name back for the client
    assert all(c.get("usage") is None for c in chunks)  # the usage chunk the client did not ask for: dropped
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert answer.headers["x-tokenway-endpoint"].startswith("pool/")
    assert answer.headers["x-request-id"]
    with_usage = await side.request(
        PATH,
        auth(),
        chat("hello again", max_tokens=7, stream=True, stream_options={"include_usage": True}),
        session=session,
    )
    usage = [c["usage"] for c in events(with_usage) if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 7


async def test_a_unary_answer_is_read_and_renamed(picker: Picker, envoy: EnvoyPair) -> None:
    side, session = envoy
    before = metric_total(picker.gateway.url, "tokenway_requests_total", status="ok")
    answer = await side.request(PATH, auth(), chat("one answer", max_tokens=5), session=session)
    body = json.loads(answer.body)
    assert answer.status == 200 and body["model"] == MODEL and body["usage"]["completion_tokens"] == 5
    await wait_for_async(lambda: metric_total(picker.gateway.url, "tokenway_requests_total", status="ok") >= before + 1)


async def test_requests_sharing_a_prefix_go_to_its_holder(picker: Picker, envoy: EnvoyPair) -> None:
    side, session = envoy
    prefix = " ".join(f"{uuid.uuid4().hex[:6]}-{i}" for i in range(300))
    first = await side.request(PATH, auth(), chat(prefix + " first?", max_tokens=4), session=session)
    for i in range(3):
        again = await side.request(PATH, auth(), chat(prefix + f" question {i}?", max_tokens=4), session=session)
        assert again.endpoint == first.endpoint


@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ({"content-type": "application/json"}, chat("hi"), 401, "invalid_api_key"),
        (
            auth(),
            orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "model_not_found",
        ),
        (auth(), b"{not json", 400, None),
    ],
    ids=["no-key", "unknown-model", "bad-json"],
)
async def test_refusals_are_immediate_responses_in_openai_shape(
    envoy: EnvoyPair, headers: dict[str, str], body: bytes, status: int, code: str | None
) -> None:
    side, session = envoy
    answer = await side.request(PATH, headers, body, session=session)
    assert answer.immediate and answer.status == status
    error = json.loads(answer.body)["error"]
    assert error["message"] and (code is None or error["code"] == code)


async def test_rate_limited_is_a_429_with_retry_after(envoy: EnvoyPair) -> None:
    side, session = envoy
    answers = [await side.request(PATH, auth(OTHER_KEY), chat("x", max_tokens=2), session=session) for _ in range(3)]
    limited = [a for a in answers if a.immediate]
    assert limited and all(a.status == 429 and "retry-after" in a.headers for a in limited)
    assert json.loads(limited[0].body)["error"]["code"] == "rate_limit_exceeded"


async def test_the_subset_hint_is_obeyed(picker: Picker, envoy: EnvoyPair) -> None:
    side, session = envoy
    only = picker.hosts[1]
    for _ in range(3):
        answer = await side.request(PATH, auth(), chat("anywhere", max_tokens=2), subset=[only], session=session)
        assert answer.endpoint == only
    none = await side.request(PATH, auth(), chat("nowhere", max_tokens=2), subset=["10.9.9.9:80"], session=session)
    assert none.immediate and none.status == 503


async def test_a_cut_stream_settles_exactly_once(picker: Picker, envoy: EnvoyPair) -> None:
    side, session = envoy
    before = metric_total(picker.gateway.url, "tokenway_requests_total", status="aborted")
    body = chat("a long answer", max_tokens=2000, stream=True, ignore_eos=True)
    answers = await asyncio.gather(
        *(side.request(PATH, auth(), body, cut_after_chunks=3, session=session) for _ in range(4))
    )
    assert all(a.status == 200 for a in answers)
    await wait_for_async(
        lambda: metric_total(picker.gateway.url, "tokenway_requests_total", status="aborted") >= before + 4
    )
    await wait_for_async(lambda: _inflight(picker) == 0)
    assert _leases_active(picker) == 0  # every concurrency lease returned, none twice (never negative)


async def test_a_response_the_picker_never_sees_is_charged_as_reserved(picker: Picker, envoy: EnvoyPair) -> None:
    """`response_body_mode: NONE`: the answer passes the picker by; its stream's end counts as
    served (not aborted), charged its whole reservation, the concurrency lease returned."""
    side, session = envoy
    url = picker.gateway.url

    def output_tokens() -> float:
        return metric_total(url, "tokenway_tokens_total", token_type="output")

    ok_before = metric_total(url, "tokenway_requests_total", status="ok")
    aborted_before = metric_total(url, "tokenway_requests_total", status="aborted")
    out = output_tokens()
    answer = await side.request(PATH, auth(), chat("hello", max_tokens=9), session=session, response_body=False)
    assert answer.status == 200 and json.loads(answer.body)["choices"]
    await wait_for_async(lambda: metric_total(url, "tokenway_requests_total", status="ok") >= ok_before + 1)
    assert metric_total(url, "tokenway_requests_total", status="aborted") == aborted_before
    assert output_tokens() - out == 9  # the output reservation (max_tokens), as no usage was seen
    await wait_for_async(lambda: _inflight(picker) == 0)
    assert _leases_active(picker) == 0


async def test_grpc_health_services(picker: Picker) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            # Readiness is re-checked once a second against the pools' health: on a loaded machine the
            # first check can still see an endpoint an earlier test left busy, so poll for SERVING.
            deadline = time.monotonic() + 30.0
            while True:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                if reply.status == health_pb2.HealthCheckResponse.SERVING or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_manifest_path() -> None:
    assert (Path(__file__).resolve().parents[2] / "deploy/k8s/overlays/gie-epp/inference-pool.yaml").is_file()

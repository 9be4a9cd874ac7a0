"""Clients never steer the engine through the endpoint picker either: `tokenway epp` against a real
simulated engine, with a gRPC client playing Envoy (tests/support/envoy_side.py) in both request
body modes a data plane may configure (FULL_DUPLEX_STREAMED, the Inference Extension's; BUFFERED).

Envoy sends the engine only the body the picker gives back, so the picker must give back the walk's
body: a client's `kv_transfer_params` / `disaggregated_params` / `priority` / ... dropped (an SSRF and
a queue jump otherwise), the tenant's tier as the engine priority, a trusted tenant's named extras
kept, the gateway's own prefix-cache salt for the tenant; and with a changed body the client's
`content-length` must not survive (removed in FULL_DUPLEX_STREAMED, set to the new length in
BUFFERED). The pool serves the public model name (no rename), so a clean body gains only the salt.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from policies.policy import cache_salt
from tests.support.engine_control import HOSTILE_FIELDS, SHED_KEY, TRUSTED_KEY, engine_control_policies
from tests.support.envoy_side import Answer, EnvoySide, Picker, envoy_pair, running_picker
from tests.support.procs import TEST_KEY, start_sim, static_pool

pytestmark = pytest.mark.e2e

MODEL = "llama-3.1-8b"
PATH = "/v1/chat/completions"
MODES = pytest.mark.parametrize("buffered", [False, True], ids=["full-duplex", "buffered"])


@pytest.fixture(scope="module")
def picker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    workdir = tmp_path_factory.mktemp("epp-engine-control")
    engines = start_sim(workdir, count=1, served_model_name=MODEL)
    policies = engine_control_policies(MODEL)
    with running_picker(
        workdir, engines, pools=[static_pool("pool", MODEL, engines.urls)], policies=policies
    ) as picker:
        yield picker


@pytest.fixture
async def envoy(picker: Picker) -> AsyncIterator[tuple[EnvoySide, aiohttp.ClientSession]]:
    async with envoy_pair(picker) as pair:
        yield pair


def chat(**extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})


async def send(
    envoy: tuple[EnvoySide, aiohttp.ClientSession], key: str, body: bytes, *, buffered: bool
) -> tuple[Answer, dict[str, Any]]:
    side, session = envoy
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json", "content-length": str(len(body))}
    answer = await side.request(PATH, headers, body, session=session, buffered=buffered)
    assert not answer.immediate and answer.status == 200, (answer.status, answer.body[:300])
    return answer, json.loads(answer.forwarded_body)


def assert_length_handled(answer: Answer, *, buffered: bool) -> None:
    """A changed body's length is not the client's: Envoy must not send the client's content-length."""
    if buffered:
        assert answer.headers["content-length"] == str(len(answer.forwarded_body))
    else:
        assert "content-length" in answer.removed


@MODES
async def test_engine_control_fields_from_a_client_never_reach_the_engine(
    envoy: tuple[EnvoySide, aiohttp.ClientSession], buffered: bool
) -> None:
    answer, forwarded = await send(envoy, TEST_KEY, chat(**HOSTILE_FIELDS), buffered=buffered)
    leaked = sorted((set(HOSTILE_FIELDS) - {"cache_salt"}) & set(forwarded))
    assert leaked == [], f"engine-control fields Envoy would send the engine: {leaked}"
    assert forwarded["cache_salt"] == cache_salt("tenant:t1")  # the gateway's, not the client's
    assert answer.body_mutated
    assert forwarded["messages"] == [{"role": "user", "content": "hi"}] and forwarded["max_tokens"] == 4
    assert_length_handled(answer, buffered=buffered)
    assert json.loads(answer.body)["usage"]["completion_tokens"] == 4  # the engine served the cleaned body


@MODES
async def test_the_engine_priority_is_the_tenants_tier(
    envoy: tuple[EnvoySide, aiohttp.ClientSession], buffered: bool
) -> None:
    answer, forwarded = await send(envoy, SHED_KEY, chat(priority=2), buffered=buffered)  # sheddable asks critical
    assert forwarded["priority"] == 2  # sheddable (-2) on vLLM's scale (lower runs first): last, not first
    assert_length_handled(answer, buffered=buffered)
    _, unasked = await send(envoy, SHED_KEY, chat(), buffered=buffered)
    assert unasked["priority"] == 2  # the tier's priority is set even when the client names none


@MODES
async def test_a_clean_body_gains_only_the_tenants_cache_salt(
    envoy: tuple[EnvoySide, aiohttp.ClientSession], buffered: bool
) -> None:
    body = b'{"model": "llama-3.1-8b",  "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
    answer, forwarded = await send(envoy, TEST_KEY, body, buffered=buffered)
    assert forwarded == {**json.loads(body), "cache_salt": cache_salt("tenant:t1")}
    assert answer.body_mutated
    assert_length_handled(answer, buffered=buffered)


@MODES
async def test_a_trusted_tenant_keeps_the_extras_its_policy_names(
    envoy: tuple[EnvoySide, aiohttp.ClientSession], buffered: bool
) -> None:
    answer, forwarded = await send(envoy, TRUSTED_KEY, chat(**HOSTILE_FIELDS), buffered=buffered)
    assert forwarded["cache_salt"] == cache_salt("tenant:trusted", "my-salt")  # its own, in its own cache
    assert forwarded["priority"] == -2  # its own priority 2 (critical), on vLLM's scale
    assert not {"kv_transfer_params", "disaggregated_params", "vllm_xargs", "request_id"} & set(forwarded)
    assert_length_handled(answer, buffered=buffered)

"""Identifiers and ownership through a real gateway (memory and Redis state) over a simulated engine:
response ids are the gateway's own (two requests sending one `x-request-id` get two responses, on the
native and the translated path, streamed or not), one key flooding the Responses store loses only its
own oldest responses, another key's ids answer 404, and only canonical paths are served (a `..`,
`.`, `//` or percent-encoded dot or slash answers 400 in the API's shape, never another route)."""
# mypy: disable-error-code="arg-type, call-overload"

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.e2e.test_agent_apis import ENGINE_MODEL, policies, pools
from tests.support.procs import OTHER_KEY, TEST_KEY, Gateway, SimEngines

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PER_KEY = 4


def raw_get(gateway: Gateway, path: str, key: str = TEST_KEY) -> tuple[int, Any]:
    """GET `path` byte for byte as written (http.client neither normalises nor re-encodes it)."""
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(body)
    except json.JSONDecodeError:
        return response.status, body


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def gateway(
    request: pytest.FixtureRequest,
    sim_factory: Callable[..., SimEngines],
    gateway_factory: Callable[..., Gateway],
) -> Gateway:
    sections: dict[str, Any] = {}
    if request.param == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
        sections["state"] = {"backend": "redis", "redis_url": url, "key_prefix": prefix}
    engines = sim_factory(count=1, time_scale=50.0, served_model_name=ENGINE_MODEL)
    return gateway_factory(
        pools=pools(engines.urls[0]),
        policies=policies(),
        apis={"response_store": {"max_responses_per_key": PER_KEY}},
        **sections,
    )


@pytest.mark.parametrize("model", ["native", "chat"])
def test_one_request_id_two_responses_and_a_flood_evicts_only_its_own(gateway: Gateway, model: str) -> None:
    mine = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    other = openai.OpenAI(base_url=gateway.base_url, api_key=OTHER_KEY, max_retries=0)
    neighbour = other.responses.create(model=model, input="the neighbour's question")

    same = {"x-request-id": "same-request-id"}
    first = mine.responses.create(model=model, input="first", extra_headers=same)
    second = mine.responses.create(model=model, input="second", extra_headers=same)
    assert first.id != second.id and "same-request-id" not in first.id + second.id
    assert first.id.startswith("resp_") and len(first.id) >= 5 + 24
    assert mine.responses.retrieve(first.id).output_text == first.output_text  # not overwritten
    assert mine.responses.retrieve(second.id).output_text == second.output_text

    with mine.responses.stream(model=model, input="streamed", extra_headers=same) as stream:
        created = [e.response.id for e in stream if e.type in ("response.created", "response.in_progress")]
        final = stream.get_final_response()
    assert created and set(created) == {final.id} and final.id not in (first.id, second.id)
    assert mine.responses.retrieve(final.id).output_text == final.output_text

    for call in (other.responses.retrieve, other.responses.delete):  # another key's id: unknown
        with pytest.raises(openai.NotFoundError):
            call(first.id)

    flood = [mine.responses.create(model=model, input=f"flood {i}").id for i in range(PER_KEY + 2)]
    assert other.responses.retrieve(neighbour.id).output_text == neighbour.output_text  # untouched
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(first.id)  # its own oldest made room
    assert [mine.responses.retrieve(r).id for r in flood[-PER_KEY:]] == flood[-PER_KEY:]


def test_only_canonical_paths_are_served(gateway: Gateway) -> None:
    c = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    body = {"model": "native", "messages": [{"role": "user", "content": "hi"}]}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    file = c.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch").id
    assert raw_get(gateway, f"/v1/files/{file}/content")[0] == 200
    for path in (
        f"/v1/files/{file}/../{file}/content",
        f"/v1/files/{file}/./content",
        f"/v1//files/{file}/content",
        f"//v1/files/{file}",
        f"/v1/files/{file}%2F..%2F{file}/content",
        f"/v1/files/%2e%2e/v1/files/{file}",
        f"/v1/files/{file}%2fcontent",
        f"/v1/files/{file}\\content",
        "/v1/responses/../models",
    ):
        status, body = raw_get(gateway, path)
        assert status == 400 and body["error"]["code"] == "invalid_path", (path, status, body)
    status, body = raw_get(gateway, "/v1/messages/../models")
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    for probe in (f"{file}:data", f"{file}:idx", "file-x}:data", "batch_1:res"):  # store keys, not ids
        assert raw_get(gateway, f"/v1/files/{probe}")[0] == 404
        assert raw_get(gateway, f"/v1/batches/{probe}")[0] == 404
    for probe in ("index", "sizes"):
        assert raw_get(gateway, f"/v1/responses/{probe}")[0] == 404
    assert raw_get(gateway, f"/v1/files/{file}?after=a/../b")[0] == 200  # the query is not the path

"""A native answer the client gets as the engine wrote it where nothing in it changes, re-encoded
where something does; a stored entry decodes to the response the client got and its conversation."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from gateway.apis.messages import MessagesCall
from gateway.apis.responses import ResponsesCall
from gateway.apis.store import MemoryResponseStore, entry_blob
from gateway.app.settings import ResponseStoreSettings
from policies.types import Principal

MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "model": "m",
    "content": [],
    "usage": {"input_tokens": 3, "output_tokens": 2},
}


def _response(**fields: Any) -> dict[str, Any]:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}]
    response = {"id": "resp_1", "object": "response", "status": "completed", "model": "m", "output": output}
    return {**response, "usage": {"input_tokens": 3, "output_tokens": 2}, **fields}


def _native_messages() -> MessagesCall:
    call = MessagesCall()
    call.parse({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]})
    call.native = True
    return call


def test_native_message_passes_through_unless_the_model_name_changes() -> None:
    body, usage = _native_messages().unary(dict(MESSAGE), public_model="m")
    assert body is None and usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 2)
    body, _ = _native_messages().unary(dict(MESSAGE), public_model="public")
    assert body is not None and orjson.loads(body)["model"] == "public"


def _native_responses(kept: MemoryResponseStore | None = None, **request: Any) -> ResponsesCall:
    call = ResponsesCall(kept)
    call.parse({"model": "m", "input": "q", **request})
    call.native = True
    return call


def test_a_native_response_is_re_encoded_under_the_gateways_own_id() -> None:
    for request, answer in [
        ({"store": False}, _response(store=False, previous_response_id=None)),  # as the client asked
        ({"store": False}, _response()),  # the engine did not echo store / previous_response_id
        ({}, _response(store=False, previous_response_id=None)),  # store: true by default
        ({"store": False}, _response(store=True, previous_response_id=None)),
    ]:
        call = _native_responses(None, **request)
        body, _ = call.unary(answer, public_model="m")
        assert body is not None
        written = orjson.loads(body)
        assert written["store"] == request.get("store", True) and written["previous_response_id"] is None
        assert written["id"] == call.response_id != "resp_1"  # never the engine's id


def test_two_calls_never_share_a_response_id() -> None:
    ids = {_native_responses(None).response_id for _ in range(200)}
    assert len(ids) == 200
    assert all(i.startswith("resp_") and len(i) >= 5 + 24 for i in ids)


def test_stored_entry_holds_the_bytes_the_client_got() -> None:
    async def scenario() -> None:
        store = MemoryResponseStore(ResponseStoreSettings())
        call = _native_responses(store)
        await call.prepare(call.body, Principal(key_id="k", tenant="t", allowed_models=None, priority=0), None)
        body, _ = call.unary(_response(), public_model="m")
        assert body is not None
        await call.finished()
        assert await store.get("k", "resp_1") is None  # the engine's id names nothing
        entry = await store.get("k", call.response_id)
        assert entry is not None and entry["response"] == orjson.loads(body)
        assert [item["type"] for item in entry["items"]] == ["message", "message"]

    asyncio.run(scenario())
    assert orjson.loads(entry_blob(b'{"id":"r"}', [{"type": "message"}])) == {
        "response": {"id": "r"},
        "items": [{"type": "message"}],
    }


def test_a_stored_response_put_again_replaces_its_entry_and_its_bytes() -> None:
    async def scenario() -> None:
        store = MemoryResponseStore(ResponseStoreSettings())
        assert await store.put("k", "r", b'{"response":{"id":"r"},"items":[]}')
        second = b'{"response":{"id":"r","status":"completed"},"items":[]}'
        assert await store.put("k", "r", second)
        assert len(store) == 1 and store.bytes == len(second)
        assert await store.delete("k", "r") and store.bytes == 0

    asyncio.run(scenario())

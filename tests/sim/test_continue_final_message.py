"""vLLM's `continue_final_message`: the last (assistant) message is continued, not closed."""

from __future__ import annotations

import aiohttp

from backends import tokenization
from sim.server import SimInstance
from tests.sim.conftest import post_json


async def test_the_assistant_message_is_continued(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    user = {"role": "user", "content": "Tell me a story"}
    partial = {"role": "assistant", "content": "Once upon a time"}
    body = {
        "messages": [user, partial],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 5,
        "ignore_eos": True,
    }
    data = await post_json(http, engine.url + "/v1/chat/completions", body)
    head = tokenization.chat_prompt_ids([user])  # ends with the assistant header
    expected = len(head) + len(tokenization.encode("Once upon a time"))  # no footer, no second header
    assert data["usage"]["prompt_tokens"] == expected
    assert data["usage"]["completion_tokens"] == 5


async def test_both_flags_or_a_user_last_are_refused(engine: SimInstance, http: aiohttp.ClientSession) -> None:
    user = {"role": "user", "content": "hi"}
    url = engine.url + "/v1/chat/completions"
    async with http.post(url, json={"messages": [user], "continue_final_message": True}) as resp:
        assert resp.status == 400  # add_generation_prompt defaults to true
    body = {"messages": [user], "continue_final_message": True, "add_generation_prompt": False}
    async with http.post(url, json=body) as resp:
        assert resp.status == 400

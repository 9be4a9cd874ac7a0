from __future__ import annotations

from typing import Any

import pytest

from backends import tokenization
from policies.estimate import PromptEstimator

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant. " * 20},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}, {"type": "image_url", "image_url": {}}]},
]


async def test_chat_count_equals_the_engine_rendering() -> None:
    estimator = PromptEstimator()
    count, ids = await estimator.chat(MESSAGES, want_ids=True)
    expected = tokenization.chat_prompt_ids(MESSAGES)
    assert count == len(expected)
    assert ids is not None and list(ids) == expected


async def test_tools_count_too() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    count, _ = await PromptEstimator().chat(MESSAGES, tools)
    assert count == len(tokenization.chat_prompt_ids(MESSAGES, tools))


async def test_repeated_messages_are_encoded_once() -> None:
    estimator = PromptEstimator()
    await estimator.chat(MESSAGES)
    misses = estimator.stats()["misses"]
    await estimator.chat([*MESSAGES, {"role": "user", "content": "one more"}])
    assert estimator.stats()["misses"] == misses + 1


async def test_large_text_is_encoded_off_loop_with_the_same_result() -> None:
    estimator = PromptEstimator(offload_chars=100)
    text = "the quick brown fox jumps over the lazy dog " * 500
    count, _ = await estimator.completion(text)
    assert count == len(tokenization.encode(text))


async def test_cache_is_bounded_in_tokens() -> None:
    estimator = PromptEstimator(cache_max_tokens=2_000)
    for i in range(200):
        await estimator.completion(f"unique prompt number {i} with some padding words")
    assert estimator.stats()["tokens"] <= 2_000


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [pytest.param([1, 2, 3], 3, id="token-ids"), pytest.param("hello world", 2, id="text")],
)
async def test_completion_prompts(prompt: str | list[int], expected: int) -> None:
    count, _ = await PromptEstimator().completion(prompt)
    assert count == expected

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from backends import tokenization
from policies.estimate import SOURCE_ESTIMATE, PromptCount, PromptEstimator

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


# --- per-model counters ------------------------------------------------------------------------------


class _Fixed:
    """A counter that answers a fixed count, or None (cannot count), and records calls."""

    def __init__(self, source: str, tokens: int | None) -> None:
        self.source, self.tokens, self.calls = source, tokens, 0

    async def count(self, api: str, body: Mapping[str, Any]) -> PromptCount | None:
        self.calls += 1
        return None if self.tokens is None else PromptCount(self.tokens, None, self.source)

    def describe(self) -> dict[str, object]:
        return {"source": self.source}


CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


async def test_counters_are_tried_in_order_and_cl100k_is_the_labelled_last_resort() -> None:
    estimator = PromptEstimator()
    failing, engine = _Fixed("model", None), _Fixed("engine", 42)
    estimator.configure("m", [failing, engine])
    assert await estimator.count("chat", CHAT, "m") == PromptCount(42, None, "engine")
    assert (failing.calls, engine.calls) == (1, 1)
    counted = await PromptEstimator().count("chat", CHAT, "m")
    assert counted.source == SOURCE_ESTIMATE and counted.tokens == len(tokenization.chat_prompt_ids(CHAT["messages"]))
    estimator.configure("m", [], note="no tokenizer")
    assert estimator.describe("m")["exact"] is False and estimator.describe("m")["note"] == "no tokenizer"
    estimator.configure("sim-model", [], cl100k_exact=True)
    assert (await estimator.count("chat", CHAT, "sim-model")).source == "sim"
    assert (await estimator.count("chat", CHAT, "unknown")).source == SOURCE_ESTIMATE


async def test_audit_counts_agreement_with_the_engine() -> None:
    estimator = PromptEstimator()
    estimator.audit("m", 10, 10, "model")
    estimator.audit("m", 10, 12, "estimate")
    audit = estimator.describe("m")["audit"]
    assert (audit["requests"], audit["equal"], audit["mismatches"]) == (2, 1, 1)
    assert audit["last_mismatch"] == {"counted": 10, "engine": 12, "source": "estimate"}
    assert audit["by_source"] == {"model": 1, "estimate": 1}

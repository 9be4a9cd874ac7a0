"""Prompt counts from the model's own tokenizer and chat template (`backends/model_tokenizer.py`).

A chat template renders the whole conversation at once, so ids cannot be cached per message as the
cl100k path does; they are cached per prompt instead (retries, fallbacks, repeated prompts and the
precise index's lookups all reuse them), keyed by a 64-bit xxhash of exactly what changes the
rendering, in the client's own key order (a tool's `parameters` are rendered as sent). Prompts
longer than `offload_chars` are rendered and encoded in a worker thread: `tokenizers` releases the
GIL, so the event loop keeps serving. The threshold is lower than cl100k's: the whole conversation is
encoded each time, and `tokenizers` runs several times slower than tiktoken per character
(bench/results/prompt-count.md).

A request this renderer does not reproduce exactly (images, a per-request template) returns None,
and the estimator asks the next counter (the engine's /tokenize, then the labelled estimate).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import orjson
import xxhash

from backends.chat_template import UnsupportedPrompt
from backends.model_tokenizer import ChatOptions, ModelTokenizer
from policies.estimate import SOURCE_MODEL, PromptCount, _IdCache

_CHAT_KEYS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template_kwargs",
    "documents",
)


def _size(body: Mapping[str, Any], api: str) -> int:
    """Characters of prompt text, roughly: decides whether to leave the event loop."""
    if api == "chat":
        return sum(len(str(m.get("content") or "")) for m in body.get("messages", ()) if isinstance(m, Mapping))
    value = body.get("prompt") if api == "completions" else body.get("input")
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list) and value and isinstance(value[0], str):
        return sum(len(v) for v in value)
    return 0


class ModelTokenizerCounter:
    """Counts as the engine does, from the files the engine loads; `source` is "model"."""

    source = SOURCE_MODEL

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        *,
        cache_max_tokens: int = 2_000_000,
        offload_chars: int = 2_048,
        executor: Executor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.offload_chars = offload_chars
        self._executor = executor
        self._cache = _IdCache(cache_max_tokens)
        self.unsupported = 0

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "path": self.tokenizer.name,
            "chat_template": self.tokenizer.has_chat_template,
            "cache_entries": len(self._cache),
            "cache_hits": self._cache.hits,
            "unsupported": self.unsupported,
        }

    async def count(self, api: str, body: Mapping[str, Any]) -> PromptCount | None:
        if api == "embeddings" or _is_batch(api, body):
            counted: PromptCount | None = await self._run(body, api, _count_texts)
            return counted
        key = _key(api, body)
        ids = self._cache.get(key)
        if ids is None:
            computed = await self._run(body, api, _prompt_ids)
            if computed is None:
                return None
            ids = computed
            self._cache.put(key, ids)
        return PromptCount(len(ids), ids, SOURCE_MODEL)

    async def _run(self, body: Mapping[str, Any], api: str, work: Any) -> Any:
        try:
            if _size(body, api) < self.offload_chars:
                result = work(self.tokenizer, api, body)
            else:
                result = await asyncio.get_running_loop().run_in_executor(
                    self._executor, work, self.tokenizer, api, body
                )
        except UnsupportedPrompt:
            self.unsupported += 1
            return None
        return result


def _key(api: str, body: Mapping[str, Any]) -> int:
    parts = {k: body[k] for k in _CHAT_KEYS if k in body} if api == "chat" else {"prompt": body.get("prompt")}
    return xxhash.xxh3_64_intdigest(api.encode() + b"\x00" + orjson.dumps(parts))


def _prompt_ids(tokenizer: ModelTokenizer, api: str, body: Mapping[str, Any]) -> array[int]:
    if api == "chat":
        ids: Sequence[int] = tokenizer.chat_ids(body["messages"], body.get("tools"), ChatOptions.of(body))
    else:
        ids = tokenizer.completion_ids(body["prompt"])
    return array("I", ids)


def _is_batch(api: str, body: Mapping[str, Any]) -> bool:
    prompt = body.get("prompt")
    return api == "completions" and isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)


def _count_texts(tokenizer: ModelTokenizer, api: str, body: Mapping[str, Any]) -> PromptCount:
    """Embeddings inputs and batched completions prompts: each with special tokens, summed, no ids."""
    value = body["input"] if api == "embeddings" else body["prompt"]
    if isinstance(value, str):
        value = [value]
    if value and isinstance(value[0], str):
        tokens = sum(len(ids) for ids in tokenizer.encode_batch(value, add_special_tokens=True))
    elif value and isinstance(value[0], list):
        tokens = sum(len(v) for v in value)
    else:
        tokens = len(value)
    return PromptCount(tokens, None, SOURCE_MODEL)

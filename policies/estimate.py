"""Prompt-token estimation for admission and routing.

Tokenization is the largest per-request cost of the gateway, so each distinct message is encoded
once: ids are cached by a 64-bit xxhash of (role, text) in a bounded LRU whose budget is counted in
tokens (ids are stored as packed uint32 arrays, 4 bytes a token). System prompts and conversation
history repeat across requests, so a typical chat turn encodes only its newest message. New text
longer than `offload_chars` is encoded in a worker thread (tiktoken releases the GIL) so a 100k-token
prompt never stalls the event loop.

The counts follow `backends/tokenization.py` exactly, so they equal the simulated engine's `usage`.
"""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import xxhash

from backends import tokenization


class _IdCache:
    """LRU of packed token ids bounded by the total number of tokens held."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[int, array[int]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: int) -> array[int] | None:
        ids = self._entries.get(key)
        if ids is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return ids

    def put(self, key: int, ids: array[int]) -> None:
        if len(ids) > self.max_tokens // 4:
            return  # one huge message must not flush everything else
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= len(old)
        self._entries[key] = ids
        self.tokens += len(ids)
        while self.tokens > self.max_tokens and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self.tokens -= len(evicted)

    def __len__(self) -> int:
        return len(self._entries)


class PromptEstimator:
    def __init__(
        self,
        *,
        cache_max_tokens: int = 4_000_000,
        offload_chars: int = 16_384,
        executor: Executor | None = None,
    ) -> None:
        self._cache = _IdCache(cache_max_tokens)
        self.offload_chars = offload_chars
        self._executor = executor

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._cache),
            "tokens": self._cache.tokens,
            "bytes": self._cache.tokens * 4,
            "hits": self._cache.hits,
            "misses": self._cache.misses,
        }

    async def _encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        total_chars = sum(len(t) for t in texts)
        if total_chars < self.offload_chars:
            return [tokenization.encode(t) for t in texts]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _encode_batch, list(texts))

    async def _cached_ids(self, keyed_texts: Sequence[tuple[int, str]]) -> list[array[int]]:
        """Ids for each (key, text), encoding only the misses (in one batch, off-loop when large)."""
        found: list[array[int] | None] = [self._cache.get(key) for key, _ in keyed_texts]
        missing = [i for i, ids in enumerate(found) if ids is None]
        if missing:
            encoded = await self._encode_many([keyed_texts[i][1] for i in missing])
            for i, ids in zip(missing, encoded, strict=True):
                packed = array("I", ids)
                self._cache.put(keyed_texts[i][0], packed)
                found[i] = packed
        return [ids for ids in found if ids is not None]

    async def chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None, *, want_ids: bool = False
    ) -> tuple[int, array[int] | None]:
        """(prompt tokens, ids if asked) of a chat request, rendered as the engine renders it."""
        keyed: list[tuple[int, str]] = []
        headers: list[tuple[int, ...]] = []
        footer_len = len(tokenization.footer_ids())
        tools_ids = tokenization.tools_ids(tools) if tools else []  # rare and small: not cached
        for message in messages:
            role = str(message.get("role", "user"))
            text = tokenization.message_text(message)
            keyed.append((_key(f"{role}\x00{text}"), text))
            headers.append(tokenization.role_header(role))
        bodies = await self._cached_ids(keyed)
        generation = tokenization.generation_prompt_ids()
        count = len(tools_ids) + len(generation)
        for header, body in zip(headers, bodies, strict=True):
            count += len(header) + len(body) + footer_len
        if not want_ids:
            return count, None
        footer = array("I", tokenization.footer_ids())
        ids = array("I", tools_ids)
        for header, body in zip(headers, bodies, strict=True):
            ids.extend(array("I", header))
            ids += body
            ids += footer
        ids.extend(array("I", generation))
        return count, ids

    async def completion(self, prompt: str | Sequence[int], *, want_ids: bool = False) -> tuple[int, array[int] | None]:
        if not isinstance(prompt, str):
            ids = array("I", prompt)
            return len(ids), ids if want_ids else None
        (body,) = await self._cached_ids([(_key(prompt), prompt)])
        return len(body), body if want_ids else None

    async def texts(self, texts: Sequence[str]) -> int:
        """Total tokens of several plain texts (embeddings input, batched prompts)."""
        bodies = await self._cached_ids([(_key(t), t) for t in texts])
        return sum(len(b) for b in bodies)


def _key(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


def _encode_batch(texts: list[str]) -> list[list[int]]:
    return tokenization.encoding().encode_batch(texts, disallowed_special=(), num_threads=1)

"""Chat prompt ids with each message's ids remembered: multi-turn clients resend the whole history
every turn, and tokenizing it again is the largest per-request cost of a simulated engine.

The last message of a request is looked up but not stored (it is usually new; it is stored when it
comes back as history), so single-message traffic costs nothing extra.

`chat_prompt_ids` returns exactly `backends.tokenization.chat_prompt_ids` (a message's ids depend
only on its role and its text, `tokenization.message_text`). One process-wide LRU, shared by every
engine of a fleet (a conversation's turns may land on different instances), bounded by the number
of tokens it holds; ids are kept as uint32 arrays (4 bytes a token).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from backends import tokenization

MAX_CACHED_TOKENS = 2_000_000


class MessageIdsCache:
    def __init__(self, max_tokens: int = MAX_CACHED_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[str, str], array[int]] = OrderedDict()

    def message_ids(self, message: Mapping[str, Any], store: bool = True) -> list[int]:
        key = (str(message.get("role", "user")), tokenization.message_text(message))
        entries = self._entries
        cached = entries.get(key)
        if cached is not None:
            entries.move_to_end(key)
            self.hits += 1
            return cached.tolist()
        self.misses += 1
        ids = tokenization.message_ids(message)
        if store and len(ids) <= self.max_tokens // 4:
            entries[key] = array("I", ids)
            self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                _key, evicted = entries.popitem(last=False)
                self.tokens -= len(evicted)
        return ids

    def chat_prompt_ids(self, messages: Iterable[Mapping[str, Any]], tools: Any = None) -> list[int]:
        """`tokenization.chat_prompt_ids`, message by message through the cache."""
        ids = tokenization.tools_ids(tools)
        messages = list(messages)
        last = len(messages) - 1
        for index, message in enumerate(messages):
            ids.extend(self.message_ids(message, store=index != last))
        ids.extend(tokenization.generation_prompt_ids())
        return ids


_CACHE = MessageIdsCache()


def chat_prompt_ids(messages: Iterable[Mapping[str, Any]], tools: Any = None) -> list[int]:
    return _CACHE.chat_prompt_ids(messages, tools)

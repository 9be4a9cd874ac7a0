"""A prompt's blocks: their chained hashes, the keys both prefix indexes store and look up, and
which endpoints hold each key.

A prompt is cut into fixed blocks; block i's key is xxh3-64 of its bytes seeded with block i-1's key
(the first seeded by model and cache_salt), so a key stands for the whole prefix up to its block and
equal keys mean equal prefixes. Only full blocks are hashed, as engines cache only full blocks.

Token ids, when the gateway has them, are hashed as little-endian uint32 so block boundaries coincide
with the engine's: they are the engine's own ids when the prompt was counted with the model's
tokenizer, the engine's /tokenize or the simulated engine's tokenizer (`policies/estimate.py`), and
cl100k ids otherwise, which the precise index does not use (they cannot match the engine's blocks).
Without ids the canonical prompt text is hashed in blocks of `4 x block_tokens` UTF-8 bytes (~4 bytes
per token) and cached-token estimates are approximate.

Owners: one dict from block key to a bitmask of endpoint slots.

Matching a prompt walks its keys once for all candidates together (O(blocks) dict lookups, not
O(candidates x blocks)): the candidates still matching are a bitmask that only shrinks, and the walk
stops when it is empty.
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import orjson
from xxhash import xxh3_64_intdigest

from backends.block_hash import hash_token_bytes
from policies.estimate import SOURCE_ESTIMATE
from policies.types import RequestFacts

BYTES_PER_TOKEN_ESTIMATE = 4

if array("I").itemsize != 4:  # pragma: no cover - every mainstream platform
    raise ImportError("array('I') must be 4 bytes")


@functools.lru_cache(maxsize=4096)  # (index, model, salt): a handful of distinct values in practice
def seed_of(*parts: str | None) -> int:
    """64-bit chain seed from naming parts (model, cache_salt, lora): different parts, disjoint keys."""
    return xxh3_64_intdigest("\x00".join(p or "" for p in parts).encode("utf-8"))


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Ids as little-endian uint32 bytes. A list costs ~10 ns per id to convert; an `array('I')` or a
    uint32 numpy array (tiktoken's `encode_to_numpy`) is copied as is."""
    if isinstance(token_ids, array) and token_ids.typecode == "I" and sys.byteorder == "little":
        return token_ids.tobytes()
    tobytes = getattr(token_ids, "tobytes", None)
    if tobytes is not None and getattr(getattr(token_ids, "dtype", None), "str", "") == "<u4":
        return bytes(tobytes())
    data = array("I", token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        data.byteswap()
    return data.tobytes()


def chain_hashes(data: bytes, block_bytes: int, seed: int, max_blocks: int) -> list[int]:
    """Keys of the leading full blocks of `data` (at most `max_blocks`)."""
    n = min(len(data) // block_bytes, max_blocks)
    keys: list[int] = []
    append = keys.append
    view = memoryview(data)
    key = seed
    for offset in range(0, n * block_bytes, block_bytes):
        key = xxh3_64_intdigest(view[offset : offset + block_bytes], key)
        append(key)
    return keys


def block_key(token_ids: Sequence[int], parent_key: int) -> int:
    """The key of one block given its parent's key (how event token ids are re-hashed)."""
    return xxh3_64_intdigest(token_bytes(token_ids), parent_key)


def canonical_prompt_bytes(body: Mapping[str, Any]) -> bytes:
    """The prompt as the engine will see it, in a canonical byte form (chat: tools then messages).

    Used only when no token ids are available. Tools and each message are serialised with sorted keys
    so that semantically equal requests hash equal and a conversation's bytes extend its prefix's.
    """
    parts: list[bytes] = []
    tools = body.get("tools")
    if tools:
        parts.append(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS))
    messages = body.get("messages")
    if isinstance(messages, list):
        parts.extend(orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            parts.append(prompt.encode("utf-8"))
        elif prompt is not None:
            parts.append(orjson.dumps(prompt))
    return b"\n".join(parts)


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """One prompt's block keys at one block size.

    `tokens_per_block` converts matched blocks to cached tokens; `exact` is False when keys come from
    text (token counts are then estimates).
    """

    keys: list[int]
    tokens_per_block: int
    prompt_tokens: int
    exact: bool

    def cached_tokens(self, matched_blocks: int) -> int:
        """Tokens an engine would serve from cache: never the whole prompt (the last token is computed)."""
        return max(min(matched_blocks * self.tokens_per_block, self.prompt_tokens - 1), 0)


@dataclass(slots=True)
class HashedPrompt:
    """One request's prompt as the prefix indexes see it, and the hashes computed from it so far.

    `engine_token_ids` are the engine's own ids (from its /tokenize, for engines whose tokenizer the
    gateway does not share); without them the gateway's ids (`facts.prompt_token_ids`) are used. The
    memo fields hold what was hashed, once per request: every candidate, a retry and `on_dispatch`
    reuse it. A new `HashedPrompt` starts a new memo (a fallback model's engines may count otherwise).
    """

    facts: RequestFacts
    engine_token_ids: Sequence[int] | None = None
    lora: str | None = None  # the LoRA adapter it runs with: the engines salt its blocks by it
    token_bytes: tuple[int, bytes] | None = field(default=None, repr=False)  # (ids converted, their bytes)
    blocks: dict[tuple[str, int], PromptBlocks | None] = field(default_factory=dict, repr=False)

    @property
    def token_ids(self) -> Sequence[int] | None:
        """Token ids as the engine counts them: the engine's own when known, else the gateway's."""
        return self.engine_token_ids if self.engine_token_ids is not None else self.facts.prompt_token_ids

    @property
    def exact_token_ids(self) -> Sequence[int] | None:
        """`token_ids` unless they are only the cl100k estimate's (the precise index cannot match those)."""
        if self.engine_token_ids is None and self.facts.prompt_tokens_source == SOURCE_ESTIMATE:
            return None
        return self.token_ids


def prompt_tokens_of(facts: RequestFacts) -> int:
    if facts.prompt_tokens:
        return facts.prompt_tokens
    return len(facts.prompt_token_ids) if facts.prompt_token_ids is not None else 0


def prompt_token_bytes(prompt: HashedPrompt, ids: Sequence[int], max_tokens: int) -> bytes:
    """`token_bytes` of the first `max_tokens` ids, converted once per request (the costliest step)."""
    cached = prompt.token_bytes
    if cached is not None and cached[0] >= max_tokens:
        return cached[1][: max_tokens * 4]
    data = token_bytes(ids[:max_tokens])
    prompt.token_bytes = (max_tokens, data)
    return data


def prompt_blocks(
    prompt: HashedPrompt,
    block_tokens: int,
    seed: int,
    max_prefix_tokens: int,
    *,
    namespace: str,
    require_ids: bool = False,
) -> PromptBlocks | None:
    """Block keys of the request's prompt, computed once per (namespace, block size) and kept in
    `prompt.blocks`, so every candidate, a retry and `on_dispatch` reuse them.

    None when `require_ids` and the request has no token ids (the precise index cannot match text).
    """
    cache = prompt.blocks
    cache_key = (namespace, block_tokens)
    if cache_key in cache:
        return cache[cache_key]
    max_blocks = max(max_prefix_tokens // block_tokens, 1)
    ids = prompt.exact_token_ids if require_ids else prompt.token_ids
    facts = prompt.facts
    result: PromptBlocks | None
    if ids is not None:
        keys = chain_hashes(prompt_token_bytes(prompt, ids, max_prefix_tokens), block_tokens * 4, seed, max_blocks)
        result = PromptBlocks(keys, block_tokens, len(ids), exact=True)
    elif require_ids:
        result = None
    else:
        data = canonical_prompt_bytes(facts.body)
        block_bytes = block_tokens * BYTES_PER_TOKEN_ESTIMATE
        keys = chain_hashes(data, block_bytes, seed, max_blocks)
        prompt_tokens = prompt_tokens_of(facts) or len(data) // BYTES_PER_TOKEN_ESTIMATE
        result = PromptBlocks(keys, block_tokens, prompt_tokens, exact=False)
    cache[cache_key] = result
    return result


# Engines whose KV-event block hashes the gateway can reproduce, by engine kind. With a hasher for an
# endpoint's engine kind, the precise index matches requests against the engine's own hashes (exact,
# salt included); without one it uses keys re-derived from the events' token ids (see `prefix_precise.py`).
# vLLM's default sha256 over pickled tuples, seeded by `PYTHONHASHSEED`, is deliberately not
# reproduced: token keys cover it without coupling to its version.
#
# (token ids as uint32 little-endian bytes, block_size, cache_salt) -> the engine's 64-bit hashes of the
# leading full blocks. Bytes, because the request's ids are converted once and shared by every index.
EngineHasher = Callable[[bytes, int, str | None], list[int]]


# the simulated engine: `backends/block_hash.py` (a test pins the bytes form to the engine's own)
ENGINE_HASHERS: Mapping[str, EngineHasher] = MappingProxyType({"sim": hash_token_bytes})


class SlotMap:
    """Endpoint id -> small integer slot (its bit in owner masks); freed slots are reused."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        self._free: list[int] = []

    def get(self, endpoint_id: str) -> int | None:
        return self._slots.get(endpoint_id)

    def slot(self, endpoint_id: str) -> int:
        slot = self._slots.get(endpoint_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slots)
            self._slots[endpoint_id] = slot
        return slot

    def release(self, endpoint_id: str) -> int | None:
        slot = self._slots.pop(endpoint_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def ids(self) -> list[str]:
        return list(self._slots)

    def mask_of(self, endpoint_ids: Iterable[str]) -> int:
        mask = 0
        for endpoint_id in endpoint_ids:
            slot = self._slots.get(endpoint_id)
            if slot is not None:
                mask |= 1 << slot
        return mask


class OwnerMap:
    """Block key -> bitmask of the slots that hold it."""

    def __init__(self) -> None:
        self.owners: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.owners)

    def add(self, key: int, bit: int) -> None:
        owners = self.owners
        owners[key] = owners.get(key, 0) | bit

    def discard(self, key: int, bit: int) -> None:
        owners = self.owners
        mask = owners.get(key)
        if mask is None:
            return
        mask &= ~bit
        if mask:
            owners[key] = mask
        else:
            del owners[key]


def leading_matches(keys: Sequence[int], candidates_mask: int, *maps: dict[int, int]) -> dict[int, int]:
    """Matched leading blocks per slot of `candidates_mask`: slot -> count of consecutive keys held.

    A slot holds key i if its bit is set in any of `maps` (confirmed and speculative entries).
    Slots absent from the result matched nothing.
    """
    result: dict[int, int] = {}
    alive = candidates_mask
    if not alive:
        return result
    single = maps[0] if len(maps) == 1 else None
    for i, key in enumerate(keys):
        if single is not None:
            mask = single.get(key, 0)
        else:
            mask = 0
            for m in maps:
                mask |= m.get(key, 0)
        lost = alive & ~mask
        if lost:
            if i:
                while lost:
                    low = lost & -lost
                    result[low.bit_length() - 1] = i
                    lost ^= low
            alive &= mask
            if not alive:
                return result
    n = len(keys)
    while alive:
        low = alive & -alive
        result[low.bit_length() - 1] = n
        alive ^= low
    return result

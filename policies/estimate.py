"""Prompt-token counting for admission, context checks and routing (docs/architecture.md, "The walk of one
request"), and the output tokens a request reserves before it runs (`output_reservation`).

The model's own tokenizer and chat template (the second section) is the first counter `count` asks;
it shares the cl100k path's cache and counts (`_IdCache`, `PromptCount`).

Counting a prompt
-----------------

Prompt-token counting for admission, context checks and routing (docs/architecture.md, "The walk of one request"),
and the output tokens a request reserves before it runs (`output_reservation`).

`count(api, body, model)` counts a request with the first of the model's counters that can, each
labelled with where its numbers come from:

- `model`: the model's own `tokenizer.json` and chat template (`policies/estimate.py`), exact;
- `engine`: the engine's `POST /tokenize`, cached (`gateway/upstream/engine_tokens.py`), exact;
- `sim`: the simulated engine's tokenizer (cl100k with its chat rendering), exact for `sim` pools;
- `estimate`: that same cl100k rendering for any other engine, the last resort: for other
  vocabularies it is off by up to 2.3x (CJK worst), which `/admin/backends` says.

Every engine-served request is audited: the count against the engine's `usage.prompt_tokens`, so a
tokenizer that drifts from its engine shows up as mismatches instead of silently mis-billing.

The cl100k path caches each distinct message once: ids are cached by a 64-bit xxhash of (role,
text) in a bounded LRU whose budget is counted in tokens (packed uint32 arrays, 4 bytes a token).
System prompts and conversation history repeat across requests, so a typical chat turn encodes only
its newest message. New text longer than `offload_chars` is encoded in a worker thread (tiktoken
releases the GIL) so a 100k-token prompt never stalls the event loop; its counts follow
`backends/tokenization.py` exactly, so they equal the simulated engine's `usage`.

The model's own tokenizer and chat template
-------------------------------------------

Prompt counts from the model's own tokenizer and chat template (`backends/tokenization.py`).

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
import threading
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import orjson
import xxhash

from backends import tokenization
from backends.tokenization import ChatOptions, ModelTokenizer, UnsupportedPrompt

SOURCE_MODEL = "model"
SOURCE_ENGINE = "engine"
SOURCE_SIM = "sim"
SOURCE_ESTIMATE = "estimate"
EXACT_SOURCES = frozenset({SOURCE_MODEL, SOURCE_ENGINE, SOURCE_SIM})


class PromptCount(NamedTuple):
    tokens: int
    ids: array[int] | None  # chat and single completions prompts; None for embeddings and batches
    source: str


class PromptCounter(Protocol):
    """Counts one model's prompts as its engine does, or returns None when it cannot (the estimator
    then asks the next counter)."""

    @property
    def source(self) -> str: ...

    async def count(self, api: str, body: Mapping[str, Any]) -> PromptCount | None: ...

    def describe(self) -> dict[str, Any]: ...


# A counter may also have `lookup(api, body, body_key)`: `count` split where it would wait, the count
# itself when cached (no coroutine is made: most prompts are repeats), else the awaitable that counts
# it, None where the counter does not apply; `body_key` (`body_key` below) replaces the counter's own
# key of the prompt. The model tokenizer's and the engine's counters have one; the estimator asks it.
Lookup = Callable[[str, Mapping[str, Any], int | None], PromptCount | Awaitable[PromptCount | None] | None]

_BODY_KEY_SEEDS = {api: xxhash.xxh3_64_intdigest(api.encode()) for api in ("chat", "completions", "embeddings")}


def body_key(api: str, raw: bytes) -> int:
    """The cache key of the prompt count of a request of `api` whose body is `raw`, the client's JSON
    as sent (after any Content-Encoding): equal bodies of one API have equal prompts. Hashing the bytes
    the gateway holds anyway is one pass over them; keying by the prompt encodes it again first (a
    copy of a long prompt, then a hash of the copy). Seeded by the API (a body may name both `messages`
    and `prompt`) and apart from the counters' own prompt keys."""
    seed = _BODY_KEY_SEEDS.get(api)
    if seed is None:
        seed = xxhash.xxh3_64_intdigest(api.encode())
    return xxhash.xxh3_64_intdigest(raw, seed)


@dataclass(slots=True)
class TokenAudit:
    """Counted prompt tokens against the engine's `usage.prompt_tokens`, per model and source.

    Besides equal / not, the error's size: the counted and reported totals (their ratio is how far a
    reservation sized by the count is from what was billed, the measure an `estimate` source, a hosted
    provider's, needs) and the lowest and highest ratio of one request. A few numbers per model."""

    requests: int = 0
    equal: int = 0
    last_mismatch: dict[str, Any] | None = None
    by_source: dict[str, int] = field(default_factory=dict)
    counted_tokens: int = 0
    reported_tokens: int = 0
    ratio_min: float | None = None  # counted / reported of one request (requests reporting 0 left out)
    ratio_max: float | None = None

    def observe(self, counted: int, engine: int, source: str) -> None:
        self.requests += 1
        self.by_source[source] = self.by_source.get(source, 0) + 1
        self.counted_tokens += counted
        self.reported_tokens += engine
        if engine > 0:
            ratio = counted / engine
            self.ratio_min = ratio if self.ratio_min is None else min(self.ratio_min, ratio)
            self.ratio_max = ratio if self.ratio_max is None else max(self.ratio_max, ratio)
        if counted == engine:
            self.equal += 1
        else:
            self.last_mismatch = {"counted": counted, "engine": engine, "source": source}

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "equal": self.equal,
            "mismatches": self.requests - self.equal,
            "by_source": dict(self.by_source),
            "last_mismatch": self.last_mismatch,
            "counted_tokens": self.counted_tokens,
            "reported_tokens": self.reported_tokens,
            "ratio": round(self.counted_tokens / self.reported_tokens, 4) if self.reported_tokens else None,
            "ratio_min": None if self.ratio_min is None else round(self.ratio_min, 4),
            "ratio_max": None if self.ratio_max is None else round(self.ratio_max, 4),
        }


class _IdCache:
    """LRU of packed token ids bounded by the total number of tokens held and by entries. Locked:
    a model tokenizer's pieces are looked up and stored from worker threads."""

    def __init__(self, max_tokens: int, max_entries: int = 1_000_000) -> None:
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self.tokens = 0
        self._entries: OrderedDict[int, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: int) -> array[int] | None:
        with self._lock:
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
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.tokens -= len(old)
            self._entries[key] = ids
            self.tokens += len(ids)
            while (self.tokens > self.max_tokens or len(self._entries) > self.max_entries) and self._entries:
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
        self._counters: dict[str, list[PromptCounter]] = {}
        self._lookups: dict[str, tuple[Lookup | None, ...]] = {}  # model -> each counter's `lookup`
        self.keys_bodies = False  # some counter takes a `body_key`: intake hashes the raw body for it
        self._cl100k_source: dict[str, str] = {}  # model -> "sim" when its engine shares cl100k
        self._notes: dict[str, str] = {}  # model -> why it has no exact counter
        self._audits: dict[str, TokenAudit] = {}

    # ------------------------------------------------------------------ per-model counting
    def configure(
        self, model: str, counters: Sequence[PromptCounter], *, cl100k_exact: bool = False, note: str = ""
    ) -> None:
        """The counters for `model`, tried in order; cl100k is the last resort (exact for `sim`)."""
        self._counters[model] = list(counters)
        lookups: tuple[Lookup | None, ...] = tuple(getattr(c, "lookup", None) for c in counters)
        self._lookups[model] = lookups
        self.keys_bodies = self.keys_bodies or any(lookup is not None for lookup in lookups)
        self._cl100k_source[model] = SOURCE_SIM if cl100k_exact else SOURCE_ESTIMATE
        if note:
            self._notes[model] = note

    async def count(self, api: str, body: Mapping[str, Any], model: str, body_key: int | None = None) -> PromptCount:
        """Prompt tokens (and ids) of a validated request body, as the model's engine counts them.
        `body_key`: `body_key(api, raw)` where the body is the client's raw JSON as sent."""
        return await self._count(api, body, model, body_key, 0, None)

    def counted(
        self, api: str, body: Mapping[str, Any], model: str, body_key: int | None = None
    ) -> PromptCount | Awaitable[PromptCount]:
        """`count`, answered at once when the model's first counter has the prompt cached: intake
        asks this once per request, and a cache hit then costs no coroutine (nor the two that
        would await it)."""
        lookups = self._lookups.get(model)
        if lookups:
            first = lookups[0]
            if first is not None:
                found = first(api, body, body_key)
                if isinstance(found, PromptCount):
                    return found
                return self._count(api, body, model, body_key, 1, found)
        return self._count(api, body, model, body_key, 0, None)

    async def _count(
        self,
        api: str,
        body: Mapping[str, Any],
        model: str,
        body_key: int | None,
        start: int,
        pending: Awaitable[PromptCount | None] | None,
    ) -> PromptCount:
        """The counters from `start` on (`pending`: the one before it, under way), then cl100k."""
        if pending is not None:
            counted = await pending
            if counted is not None:
                return counted
        counters = self._counters.get(model, ())
        lookups = self._lookups.get(model, ())
        for i in range(start, len(counters)):
            lookup = lookups[i]
            if lookup is None:
                counted = await counters[i].count(api, body)
            else:
                found = lookup(api, body, body_key)
                counted = found if found is None or isinstance(found, PromptCount) else await found
            if counted is not None:
                return counted
        return await self._count_cl100k(api, body, self._cl100k_source.get(model, SOURCE_ESTIMATE))

    def cl100k_source(self, model: str) -> str:
        """What a cl100k count is for `model`: `sim` (exact) or `estimate`."""
        return self._cl100k_source.get(model, SOURCE_ESTIMATE)

    async def _count_cl100k(self, api: str, body: Mapping[str, Any], source: str) -> PromptCount:
        if api == "chat":
            tokens, ids = await self.chat(body["messages"], body.get("tools"), want_ids=True)
            return PromptCount(tokens, ids, source)
        if api == "completions":
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                return PromptCount(await self.texts(prompt), None, source)
            tokens, ids = await self.completion(prompt, want_ids=True)
            return PromptCount(tokens, ids, source)
        value = body["input"]
        if isinstance(value, str):
            tokens = await self.texts([value])
        elif value and isinstance(value[0], str):
            tokens = await self.texts(value)
        elif value and isinstance(value[0], list):
            tokens = sum(len(v) for v in value)
        else:
            tokens = len(value)
        return PromptCount(tokens, None, source)

    def audit(self, model: str, counted: int, engine: int, source: str) -> None:
        """Record the count of a request the engine served next to the engine's own count."""
        audit = self._audits.get(model)
        if audit is None:
            if len(self._audits) >= 4096:  # models come from configuration; bound it anyway
                return
            audit = self._audits[model] = TokenAudit()
        audit.observe(counted, engine, source)

    def describe(self, model: str) -> dict[str, Any]:
        """How `model`'s prompts are counted (for /admin/backends), with the audit so far."""
        counters = [c.describe() for c in self._counters.get(model, ())]
        fallback = self._cl100k_source.get(model, SOURCE_ESTIMATE)
        info: dict[str, Any] = {
            "source": counters[0]["source"] if counters else fallback,
            "exact": bool(counters) or fallback == SOURCE_SIM,
            "counters": counters,
            "fallback": "cl100k (simulated engine's tokenizer)" if fallback == SOURCE_SIM else "cl100k estimate",
        }
        if model in self._notes:
            info["note"] = self._notes[model]
        audit = self._audits.get(model)
        info["audit"] = audit.as_dict() if audit is not None else TokenAudit().as_dict()
        return info

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
            keyed.append((_key(text, _role_seed(role)), text))
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


def _key(text: str, seed: int = 0) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"), seed)


def _role_seed(role: str) -> int:
    """A message's role as the seed of its text's key: (role, text) keyed without first joining them
    into one more copy of the text (a long prompt's message is copied once, to be hashed)."""
    return xxhash.xxh3_64_intdigest(role.encode("utf-8", "surrogatepass")) | 1  # never 0, plain texts' seed


def _encode_batch(texts: list[str]) -> list[list[int]]:
    return tokenization.encoding().encode_batch(texts, disallowed_special=(), num_threads=1)


def _output_count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def output_reservation(
    body: Mapping[str, Any],
    *,
    max_tokens: int | None,
    estimate_tokens: int,
    context_length: int | None,
    prompt_tokens: int,
) -> int:
    """The output tokens to reserve for `body` (all of its `n` choices) before it runs.

    `max_tokens` (x `n`) when the client set it. Without it the reservation is the model's
    `default_max_tokens`, which the gateway then sends the engine as the request's output limit
    (`gateway/upstream/relay.py`: no answer outgrows its reservation), and two request fields make the
    engine generate more than an estimate: `min_tokens` (vLLM, TensorRT-LLM: at least that many, EOS or
    not) and `ignore_eos` (generate until `max_tokens`, which is then the model's context). Reserving the
    estimate for those let 100 concurrent requests with `min_tokens: 1000` pass a 2,000 TPM limit ten
    times over in one burst. So the reservation is never below `min_tokens`, and `ignore_eos` without
    `max_tokens` reserves what the context leaves after the prompt: such a request is admitted when a
    whole context fits its limits, and a limit too small for that rejects it as too large, up front,
    with `x-should-retry: false` (rather than admitting it on a guess it will overrun).
    """
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    if max_tokens is not None:
        return max_tokens * choices
    per_choice = max(estimate_tokens, _output_count(body.get("min_tokens")) or 0)
    if body.get("ignore_eos") is True and context_length is not None:
        per_choice = max(per_choice, context_length - prompt_tokens, 1)
    return per_choice * choices


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


MAX_SEEN_PROMPTS = 10_000


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
        self._seen: OrderedDict[int, None] = OrderedDict()  # chat prompts counted once, by key
        self.unsupported = 0

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "path": self.tokenizer.name,
            "chat_template": self.tokenizer.has_chat_template,
            "cache_entries": len(self._cache),
            "cache_hits": self._cache.hits,
            "cache_misses": self._cache.misses,
            "pieces": self.tokenizer.pieces is not None,
            "unsupported": self.unsupported,
        }

    async def count(self, api: str, body: Mapping[str, Any]) -> PromptCount | None:
        found = self.lookup(api, body)
        return found if found is None or isinstance(found, PromptCount) else await found

    def lookup(
        self, api: str, body: Mapping[str, Any], body_key: int | None = None
    ) -> PromptCount | Awaitable[PromptCount | None] | None:
        """The cached count at once (no coroutine), else the awaitable that counts it (see `Lookup`);
        `body_key` keys the cache instead of the prompt's own key (no encoding of the prompt)."""
        if api == "embeddings" or _is_batch(api, body):
            texts: Awaitable[PromptCount | None] = self._run(body, api, _count_texts)
            return texts
        key = _prompt_key(api, body) if body_key is None else body_key
        ids = self._cache.get(key)
        if ids is not None:
            return PromptCount(len(ids), ids, SOURCE_MODEL)
        return self._count_new(api, body, key)

    async def _count_new(self, api: str, body: Mapping[str, Any], key: int) -> PromptCount | None:
        ids: array[int] | None
        if api == "chat" and self.tokenizer.pieces is not None:
            # piece by piece: a grown conversation encodes only its new pieces (backends/tokenization.py,
            # PieceEncoder). The whole prompt's ids are kept only once it came twice: a conversation's
            # prompts are each sent once, and holding them beside their pieces would crowd those out.
            ids = await self._run(body, api, _prompt_ids, self._cache)
            if ids is not None and key in self._seen:
                del self._seen[key]
                self._cache.put(key, ids)
            elif ids is not None:
                self._seen[key] = None
                if len(self._seen) > MAX_SEEN_PROMPTS:
                    self._seen.popitem(last=False)
        else:
            ids = await self._run(body, api, _prompt_ids)
            if ids is not None:
                self._cache.put(key, ids)
        return None if ids is None else PromptCount(len(ids), ids, SOURCE_MODEL)

    async def _run(self, body: Mapping[str, Any], api: str, work: Any, *args: Any) -> Any:
        try:
            if _size(body, api) < self.offload_chars:
                result = work(self.tokenizer, api, body, *args)
            else:
                result = await asyncio.get_running_loop().run_in_executor(
                    self._executor, work, self.tokenizer, api, body, *args
                )
        except UnsupportedPrompt:
            self.unsupported += 1
            return None
        return result


def _prompt_key(api: str, body: Mapping[str, Any]) -> int:
    parts = {k: body[k] for k in _CHAT_KEYS if k in body} if api == "chat" else {"prompt": body.get("prompt")}
    return xxhash.xxh3_64_intdigest(api.encode() + b"\x00" + orjson.dumps(parts))


def _prompt_ids(
    tokenizer: ModelTokenizer, api: str, body: Mapping[str, Any], cache: _IdCache | None = None
) -> array[int]:
    if api == "chat":
        ids: Sequence[int] = tokenizer.chat_ids(body["messages"], body.get("tools"), ChatOptions.of(body), cache)
    else:
        ids = tokenizer.completion_ids(body["prompt"])
    return ids if isinstance(ids, array) else array("I", ids)


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

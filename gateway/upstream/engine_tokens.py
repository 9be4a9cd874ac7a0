"""How each model's prompts are counted, and the engine's own `/tokenize` as a counter.

`build_counters` (app factory) gives every model served here its counters, in order:
1. the model's own tokenizer (`PoolConfig.tokenizer`, else `engine_model` when it is a local
   directory holding `tokenizer.json`): exact, no I/O;
2. for vLLM-protocol engines (vllm, vllm-ascend), the engine's `POST /tokenize`: exact, one round
   trip per new prompt, cached by a hash of the prompt;
3. cl100k, exact for the simulated engine (it shares that tokenizer), a labelled estimate otherwise.

`EngineTokenizer.annotate` is the precise prefix index's fallback for requests counted with the
cl100k estimate (their ids are not the engine's): it asks `/tokenize` once more for the ids.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Awaitable, Mapping
from concurrent.futures import Executor
from typing import Any

import orjson
import xxhash

from backends.fleet import Fleet, Pool
from backends.tokenization import ModelTokenizer, TokenizerLoadError, tokenizer_directory
from gateway.request import Hook, RequestContext
from gateway.upstream.client import UpstreamClient, UpstreamConnectionError
from policies.estimate import (
    EXACT_SOURCES,
    SOURCE_ENGINE,
    ModelTokenizerCounter,
    PromptCount,
    PromptEstimator,
    _IdCache,
)
from policies.types import RequestFacts

log = logging.getLogger("tokenway.engine_tokens")
ENGINES_SHARING_OUR_TOKENIZER = frozenset({"sim"})
ENGINES_WITH_TOKENIZE = frozenset({"vllm", "vllm-ascend"})
_CHAT_FIELDS = ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
_CHAT_FIELD_SET = frozenset(_CHAT_FIELDS)


def tokenizer_path(pool: Pool) -> str | None:
    """Where this pool's model tokenizer lives: the `tokenizer` setting, else a local model directory."""
    config = pool.config
    if config.tokenizer:
        return config.tokenizer
    model = config.engine_model or config.model
    return model if tokenizer_directory(model) is not None else None


def build_counters(
    fleet: Fleet, estimator: PromptEstimator, client: UpstreamClient, executor: Executor | None = None
) -> None:
    """Configure `estimator` with every model's counters (see the module docstring)."""
    loaded: dict[str, ModelTokenizerCounter] = {}
    for model in fleet.models:
        pools = fleet.pools_for_model(model)
        counters: list[Any] = []
        notes: list[str] = []
        for pool in pools:
            path = tokenizer_path(pool)
            if path is None:
                continue
            if path not in loaded:
                try:
                    loaded[path] = ModelTokenizerCounter(ModelTokenizer.load(path), executor=executor)
                except (TokenizerLoadError, OSError) as exc:
                    log.warning("pool %s: cannot load the tokenizer at %s: %s", pool.name, path, exc)
                    notes.append(f"pool {pool.name}: tokenizer at {path} unusable: {exc}")
                    continue
            if loaded[path] not in counters:
                counters.append(loaded[path])
        counters += [
            EngineTokenizeCounter(client, pool) for pool in pools if pool.config.engine in ENGINES_WITH_TOKENIZE
        ]
        cl100k_exact = bool(pools) and all(p.config.engine in ENGINES_SHARING_OUR_TOKENIZER for p in pools)
        if not counters and not cl100k_exact:
            engines = sorted({p.config.engine for p in pools})
            notes.append(
                f"no tokenizer for engine(s) {', '.join(engines)}: set the pool's `tokenizer` to the model's "
                "tokenizer directory for exact counts"
            )
        estimator.configure(model, counters, cl100k_exact=cl100k_exact, note="; ".join(notes))


class EngineTokenizeCounter:
    """A pool's engine counts the prompt (vLLM's `POST /tokenize`, vllm/entrypoints/serve/tokenize/): the
    chat form applies the server's own template, so the ids are exactly the ones the engine hashes. New prompts cost one
    round trip to a ready endpoint (spread over the pool); repeats hit a bounded LRU of packed ids.
    An error, a timeout or no ready endpoint returns None: the next counter decides.

    The round trip goes through the engine client every relayed request uses (pooled keep-alive
    connections, no per-call client objects), and the prompt is encoded at most once: a body seen
    before (`lookup`'s `body_key`, the raw body's hash) finds its prompt's key without encoding it;
    otherwise the encoded prompt keys the cache and, with the model spliced in front, makes the
    request."""

    source = SOURCE_ENGINE

    def __init__(
        self,
        client: UpstreamClient,
        pool: Pool,
        max_entries: int = 20_000,
        timeout_s: float = 2.0,
        max_tokens: int = 4_000_000,
    ) -> None:
        self._client = client
        self.pool = pool
        # Bounded in entries and in tokens held (4 bytes each): long prompts cannot grow it past
        # `max_tokens`, and one huge prompt is not cached at all rather than flush the rest.
        self._cache = _IdCache(max_tokens, max_entries)
        # raw body hash -> prompt key: a repeated body finds its prompt's ids without encoding the
        # prompt again; a body that differs only outside the prompt (temperature, user, max_tokens)
        # misses here and still hits the prompt's own key, with no second round trip to the engine
        self._aliases: dict[int, int] = {}
        self._max_aliases = max_entries
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.calls = 0
        self.errors = 0
        self._turn = 0

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "pool": self.pool.name,
            "cache_entries": len(self._cache),
            "cache_tokens": self._cache.tokens,
            "calls": self.calls,
            "errors": self.errors,
        }

    async def count(self, api: str, body: Mapping[str, Any]) -> PromptCount | None:
        found = self.lookup(api, body)
        return found if found is None or isinstance(found, PromptCount) else await found

    def lookup(
        self, api: str, body: Mapping[str, Any], body_key: int | None = None
    ) -> PromptCount | Awaitable[PromptCount | None] | None:
        """The count at once when the prompt is cached (no coroutine is made: most prompts are
        repeats), else the round trip that asks the engine; None where /tokenize does not apply.

        `body_key` (`policies.estimate.body_key`: the hash of the raw body, for a body that is the
        client's JSON as sent) keys the cache without encoding the prompt again: a cached long prompt
        costs one pass of a hash over bytes the gateway holds anyway, not a copy of it and a hash of
        the copy. Without it the key is the hash of the encoded /tokenize request."""
        if body_key is not None:
            key = self._aliases.get(body_key)
            ids = self._cache.get(key) if key is not None else None
            if ids is not None:
                return PromptCount(len(ids), ids, SOURCE_ENGINE)
        request = _tokenize_body(api, body)
        if request is None:
            return None
        encoded = orjson.dumps(request)
        key = xxhash.xxh3_64_intdigest(encoded)
        if body_key is not None:  # a body not seen before: the prompt may still be (other sampling fields)
            self._alias(body_key, key)
        ids = self._cache.get(key)
        if ids is not None:
            return PromptCount(len(ids), ids, SOURCE_ENGINE)
        return self._ask(key, encoded)

    def _alias(self, body_key: int, key: int) -> None:
        """Remember that the body `body_key` holds the prompt `key`; the oldest alias goes past
        `max_entries` (the ids stay in the cache under the prompt's key, counted once)."""
        aliases = self._aliases
        if body_key not in aliases and len(aliases) >= self._max_aliases:
            del aliases[next(iter(aliases))]
        aliases[body_key] = key

    async def _ask(self, key: int, request: bytes | dict[str, Any]) -> PromptCount | None:
        ids = await self.tokenize(request)
        if ids is None:
            return None
        self._cache.put(key, ids)
        return PromptCount(len(ids), ids, SOURCE_ENGINE)

    async def tokenize(self, request: bytes | dict[str, Any]) -> array[int] | None:
        """The engine's ids for `request` (a /tokenize body without its `model`: encoded, or not yet,
        when nothing needed its bytes before; then it is encoded once, the model in front)."""
        ready = self.pool.ready_endpoints()
        if not ready:
            return None
        self._turn += 1
        endpoint = ready[self._turn % len(ready)]
        headers = {"Content-Type": "application/json"}
        if endpoint.api_key:
            headers["Authorization"] = f"Bearer {endpoint.api_key}"
        self.calls += 1
        if isinstance(request, dict):
            body = orjson.dumps({"model": endpoint.served_model, **request})
        else:  # the model spliced in front of the encoded request: one copy of the prompt, no second encode
            rest = memoryview(request)[1:] if len(request) > 2 else b"}"
            body = b"".join(
                (b'{"model":', orjson.dumps(endpoint.served_model), b"," if len(request) > 2 else b"", rest)
            )
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self._client.post(endpoint.base_url + "/tokenize", headers, body)
                async with response:
                    if response.status != 200:
                        self.errors += 1
                        return None
                    answer = orjson.loads(await _bounded(response, _answer_bound(len(body))))
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
        except (UpstreamConnectionError, TimeoutError, orjson.JSONDecodeError) as exc:
            self.errors += 1
            log.debug("tokenize on %s failed: %s", endpoint.id, exc)
            return None
        if not isinstance(tokens, list):
            self.errors += 1
            return None
        try:
            return array("I", tokens)  # checks every id: an int of 0..2^32-1
        except (TypeError, OverflowError) as exc:  # an engine's answer is input: ids that are not ids
            self.errors += 1
            log.debug("tokenize on %s: unusable ids: %s", endpoint.id, exc)
            return None


def _answer_bound(request_bytes: int) -> int:
    """The most bytes a /tokenize answer for a request of `request_bytes` can need: a token per byte at
    most, each id at most 11 bytes of JSON, and room for the rest of the answer."""
    return 12 * request_bytes + 65_536


async def _bounded(response: Any, limit: int) -> bytes:
    """The answer's body, refused past `limit` bytes (an engine's answer is input: never unbounded)."""
    parts: list[bytes] = []
    size = 0
    while chunk := await response.next_chunk():
        size += len(chunk)
        if size > limit:
            raise UpstreamConnectionError(f"a /tokenize answer past {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


def _tokenize_body(api: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The /tokenize request equal to a chat or single-prompt completions request; None otherwise."""
    if api == "chat":
        request: dict[str, Any] = {"messages": body["messages"]}
        if not _CHAT_FIELD_SET.isdisjoint(body):  # most requests set none of them: no comprehension run
            request.update({k: body[k] for k in _CHAT_FIELDS if body.get(k) is not None})
        request.setdefault("add_generation_prompt", True)
        return request
    if api == "completions" and isinstance(body.get("prompt"), str):
        return {"prompt": body["prompt"]}
    return None


class EngineTokenizer(Hook):
    """The precise index's fallback (a hook, before routing): the engine's own ids for requests whose
    count was only the cl100k estimate (their ids are not the engine's)."""

    def __init__(
        self,
        client: UpstreamClient,
        fleet: Fleet,
        max_entries: int = 20_000,
        timeout_s: float = 2.0,
        max_tokens: int = 4_000_000,
    ) -> None:
        self._client = client
        self._fleet = fleet
        self._counters: dict[str, EngineTokenizeCounter] = {}
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s

    def needed(self, pool: Pool) -> bool:
        engine = pool.config.engine
        return engine not in ENGINES_SHARING_OUR_TOKENIZER and engine in ENGINES_WITH_TOKENIZE

    async def prepare(self, ctx: RequestContext) -> None:
        """The engine's own ids into the routing inputs, for the model about to be routed."""
        pools = self._fleet.pools_for_model(ctx.model)
        assert ctx.routing is not None
        ctx.routing.use_engine_token_ids(await self.token_ids(ctx.facts, pools[0]) if pools else None)

    async def token_ids(self, facts: RequestFacts, pool: Pool) -> array[int] | None:
        """The ids `pool`'s engine computes for this prompt when the count was an estimate (None: the
        gateway's own ids are already the engine's, or cannot be had)."""
        if (
            facts.api not in ("chat", "completions")
            or facts.prompt_tokens_source in EXACT_SOURCES
            or not self.needed(pool)
        ):
            return None
        counter = self._counters.get(pool.name)
        if counter is None:
            counter = self._counters[pool.name] = EngineTokenizeCounter(
                self._client, pool, self.max_entries, self.timeout_s, self.max_tokens
            )
        counted = await counter.count(facts.api, facts.body)
        return counted.ids if counted is not None else None

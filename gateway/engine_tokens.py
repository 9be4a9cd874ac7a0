"""Engine-side token ids for the precise prefix index, from the engine's own `/tokenize` (cached).

The precise index matches the blocks an engine reports in its KV events, so it needs the ids that
engine computes: its tokenizer and chat template, not ours. The simulated engine shares our tokenizer
(`backends/tokenization.py`), so its pools skip this. For real engines the ids of a prompt are asked
once from any ready endpoint of the pool and kept in an LRU keyed by a hash of the canonical prompt,
bounded in entries and in tokens held (4 bytes each), so long prompts cannot grow it past
`max_tokens`; a miss or an error simply leaves the request to the approximate index.

A hook of the walk (`prepare`, before routing on each model of the chain): a fallback model's pool
may run another engine, so the ids are asked for again, or dropped, per model.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from typing import Any

import aiohttp
import orjson
import xxhash

from backends.fleet import Fleet, Pool
from gateway.request import Hook, RequestContext
from policies.routing.prefix.hashing import canonical_prompt_bytes
from policies.types import RequestFacts

log = logging.getLogger("tokenway.engine_tokens")
ENGINES_SHARING_OUR_TOKENIZER = frozenset({"sim"})
ENGINES_WITH_TOKENIZE = frozenset({"vllm", "vllm-ascend"})


class EngineTokenizer(Hook):
    def __init__(
        self,
        session: aiohttp.ClientSession,
        fleet: Fleet,
        max_entries: int = 20_000,
        timeout_s: float = 2.0,
        max_tokens: int = 4_000_000,
    ) -> None:
        self._session = session
        self._fleet = fleet
        self._cache: OrderedDict[tuple[str, int], array[int]] = OrderedDict()
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.tokens = 0
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.errors = 0
        self._turn = 0

    def needed(self, pool: Pool) -> bool:
        engine = pool.config.engine
        return engine not in ENGINES_SHARING_OUR_TOKENIZER and engine in ENGINES_WITH_TOKENIZE

    async def prepare(self, ctx: RequestContext) -> None:
        """The engine's own ids into the routing inputs, for the model about to be routed."""
        pools = self._fleet.pools_for_model(ctx.model)
        assert ctx.routing is not None
        ctx.routing.use_engine_token_ids(await self.token_ids(ctx.facts, pools[0]) if pools else None)

    async def token_ids(self, facts: RequestFacts, pool: Pool) -> array[int] | None:
        """The ids `pool`'s engine computes for this prompt, when they can be had (None: use ours)."""
        if facts.api not in ("chat", "completions") or not self.needed(pool):
            return None
        key = (pool.name, xxhash.xxh3_64_intdigest(canonical_prompt_bytes(facts.body)))
        ids = self._cache.get(key)
        if ids is None:
            ids = await self._fetch(facts, pool)
            if ids is None:
                return None
            if len(ids) <= self.max_tokens // 4:  # one huge prompt must not flush everything else
                self._cache[key] = ids
                self.tokens += len(ids)
                while len(self._cache) > self.max_entries or self.tokens > self.max_tokens:
                    _, evicted = self._cache.popitem(last=False)
                    self.tokens -= len(evicted)
        else:
            self._cache.move_to_end(key)
        return ids

    async def _fetch(self, facts: RequestFacts, pool: Pool) -> array[int] | None:
        ready = pool.ready_endpoints()
        if not ready:
            return None
        self._turn += 1
        endpoint = ready[self._turn % len(ready)]  # spread tokenize calls over the pool
        body: dict[str, Any] = {"model": endpoint.served_model}
        if facts.api == "chat":
            body["messages"] = facts.body["messages"]
            body["add_generation_prompt"] = True
            if facts.body.get("tools"):
                body["tools"] = facts.body["tools"]
        else:
            body["prompt"] = facts.body["prompt"]
        try:
            async with self._session.post(
                endpoint.base_url + "/tokenize",
                data=orjson.dumps(body),
                timeout=self._timeout,
                headers={"Content-Type": "application/json"},
            ) as response:
                if response.status != 200:
                    self.errors += 1
                    return None
                tokens = orjson.loads(await response.read()).get("tokens")
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            self.errors += 1
            log.debug("tokenize on %s failed: %s", endpoint.id, exc)
            return None
        if not isinstance(tokens, list):
            return None
        return array("I", tokens)

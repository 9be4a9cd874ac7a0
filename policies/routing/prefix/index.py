"""The prefix index routing consults: precise where an engine's events are alive, approximate elsewhere.

In `precise` mode both indexes are kept: the approximate one is recorded at every dispatch (cheap),
so when an endpoint's events stop (or never start) its answers take over with warm data. In
`approximate` mode only the approximate index exists; `off` answers 0 everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from backends.kv_events import KvEventBatch
from backends.types import Endpoint
from policies.routing.config import PrefixIndexConfig
from policies.routing.prefix.approximate import ApproximatePrefixIndex
from policies.routing.prefix.hashing import ENGINE_HASHERS, EngineHasher, HashedPrompt
from policies.routing.prefix.precise import PrecisePrefixIndex
from policies.routing.prefix.tiers import TierTokens


@dataclass(frozen=True, slots=True)
class IndexReport:
    mode: str
    approximate_entries: int
    precise_blocks: int
    memory_bytes: int
    precise_alive: dict[str, bool]  # endpoint id -> answering from events


class PrefixIndex:
    def __init__(
        self,
        config: PrefixIndexConfig,
        *,
        engine_hashers: Mapping[str, EngineHasher] | None = None,
        offload_tokens_of: Callable[[str], int] | None = None,
    ) -> None:
        """`offload_tokens_of(pool)`: tokens each replica of the pool keeps below HBM (approximate index)."""
        self.mode = config.mode
        self.approximate: ApproximatePrefixIndex | None = None
        self.precise: PrecisePrefixIndex | None = None
        if config.mode != "off":
            self.approximate = ApproximatePrefixIndex(
                block_tokens=config.block_size_tokens,
                default_capacity_tokens=config.advanced.default_capacity_tokens,
                max_capacity_tokens=config.advanced.max_capacity_tokens,
                max_prefix_tokens=config.advanced.max_prefix_tokens,
                offload_tokens_of=offload_tokens_of,
            )
        if config.mode == "precise":
            self.precise = PrecisePrefixIndex(
                default_block_tokens=config.precise_block_size_tokens or 16,
                speculative_ttl_s=config.advanced.speculative_ttl_s,
                events_timeout_s=config.advanced.events_timeout_s,
                resync_s=config.advanced.resync_s,
                max_blocks_per_endpoint=config.advanced.max_event_blocks_per_endpoint,
                max_prefix_tokens=config.advanced.max_prefix_tokens,
                engine_hashers=(ENGINE_HASHERS if config.advanced.precise_keys == "auto" else {})
                if engine_hashers is None
                else engine_hashers,
            )

    def lookup(self, prompt: HashedPrompt, endpoints: Sequence[Endpoint], now_s: float) -> list[int]:
        """Estimated cached prompt tokens on each endpoint (same order)."""
        if self.approximate is None or not endpoints:
            return [0] * len(endpoints)
        if self.precise is None:
            return self.approximate.lookup(prompt, endpoints)
        precise = self.precise.lookup(prompt, endpoints, now_s)
        if all(v is not None for v in precise):
            return [v or 0 for v in precise]
        approx = self.approximate.lookup(prompt, endpoints)
        return [a if p is None else p for p, a in zip(precise, approx, strict=True)]

    def lookup_tiers(self, prompt: HashedPrompt, endpoints: Sequence[Endpoint], now_s: float) -> list[TierTokens]:
        """Estimated cached prompt tokens on each endpoint (same order), per KV tier."""
        if self.approximate is None or not endpoints:
            return [TierTokens()] * len(endpoints)
        if self.precise is None:
            return self.approximate.lookup_tiers(prompt, endpoints)
        precise = self.precise.lookup_tiers(prompt, endpoints, now_s)
        if all(v is not None for v in precise):
            return [v or TierTokens() for v in precise]
        approx = self.approximate.lookup_tiers(prompt, endpoints)
        return [a if p is None else p for p, a in zip(precise, approx, strict=True)]

    def record(self, prompt: HashedPrompt, endpoint: Endpoint, now_s: float) -> None:
        if self.approximate is not None:
            self.approximate.record(prompt, endpoint)
        if self.precise is not None:
            self.precise.record(prompt, endpoint, now_s)

    def record_remote(self, endpoint: Endpoint, keys: Sequence[int]) -> None:
        """Another gateway replica dispatched a prompt with these approximate block keys to `endpoint`."""
        if self.approximate is not None:
            self.approximate.record_keys(endpoint, keys)

    def dispatched_keys(self, prompt: HashedPrompt) -> list[int]:
        """The approximate block keys this request records at dispatch (what replicas share)."""
        return list(self.approximate.blocks(prompt).keys) if self.approximate is not None else []

    # KV-event callbacks (`backends.kv_events.KvEventHub(on_batch=..., on_reset=...)`).
    def on_kv_batch(self, endpoint_id: str, batch: KvEventBatch) -> None:
        if self.precise is not None:
            self.precise.apply(endpoint_id, batch)

    def on_kv_reset(self, endpoint_id: str, reason: str, now_s: float) -> None:
        if self.precise is not None:
            self.precise.reset(endpoint_id, reason, now_s)

    # A pool's shared KV store (`kv_store`): its own events, or its engines' events of a store medium.
    def add_store(self, pool: str) -> None:
        if self.precise is not None:
            self.precise.add_store(pool)

    def on_store_batch(self, pool: str, batch: KvEventBatch) -> None:
        if self.precise is not None:
            self.precise.apply_store(pool, batch)

    def on_store_reset(self, pool: str, reason: str, now_s: float) -> None:
        if self.precise is not None:
            self.precise.reset_store(pool, reason, now_s)

    def retain(self, endpoint_ids: Iterable[str]) -> None:
        """Forget endpoints that left the fleet."""
        keep = set(endpoint_ids)
        if self.approximate is not None:
            self.approximate.retain(keep)
        if self.precise is not None:
            self.precise.retain(keep)

    def memory_bytes(self) -> int:
        total = 0
        if self.approximate is not None:
            total += self.approximate.memory_bytes()
        if self.precise is not None:
            total += self.precise.memory_bytes()
        return total

    def report(self, now_s: float) -> IndexReport:
        precise_stats = self.precise.stats(now_s) if self.precise is not None else {}
        return IndexReport(
            mode=self.mode,
            approximate_entries=self.approximate.entries() if self.approximate is not None else 0,
            precise_blocks=self.precise.entries() if self.precise is not None else 0,
            memory_bytes=self.memory_bytes(),
            precise_alive={k: v.alive for k, v in precise_stats.items()},
        )

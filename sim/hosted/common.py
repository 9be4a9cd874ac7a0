"""What every hosted-provider stand-in shares: flags, latency, rate limits, prompt caching, text, usage tally.

A stand-in is one provider's documented wire format on loopback, checked by the provider's own SDK,
so that the gateway's hosted transports and the spill-over benchmark run without accounts. The
parts that make it behave like a paid API rather than a mock live here, provider-neutral:

- `StandinConfig` (the shared flags: `--ttft-ms --tpot-ms --rpm --tpm --fail-after-tokens --seed
  --api-key`), read by `add_common_args` / `config_from_args`.
- `RateLimiter`: a one-minute sliding window of requests and tokens; providers word its answer as
  their own headers (`anthropic-ratelimit-*`, `x-ratelimit-*`) and their own 429 / throttling shape.
- `PromptCache`: a prefix marked cacheable and seen before is a cache read, the first time a write;
  entries expire after their lifetime (5 minutes or 1 hour), refreshed on each read as providers do.
- `count_tokens` / `Talker`: a deterministic token count (about four bytes a token: providers'
  tokenizers differ, what matters is that the same text always counts the same) and seeded words
  (one token each) as the model's answer.
- `UsageTally`: per-model token totals served at GET /standin/usage (no prices: the benchmark prices
  them), reset by DELETE /standin/usage.
- `Latency`: time to first token and per output token, slept on the event loop.
- `Faults`: errors a test queues (POST /standin/faults) for the next requests, in the provider's shape.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from aiohttp import web

__all__ = [
    "CONFIG",
    "FAULTS",
    "TALLY",
    "CacheResult",
    "Faults",
    "Latency",
    "Limit",
    "PromptCache",
    "RateLimiter",
    "StandinConfig",
    "Talker",
    "Usage",
    "UsageTally",
    "add_common_args",
    "base_app",
    "config_from_args",
    "count_tokens",
    "json_response",
    "sample_json",
    "split_words",
]


@dataclass(frozen=True, slots=True)
class StandinConfig:
    """The flags every stand-in takes; 0 means "no limit" for rpm, tpm and fail_after_tokens."""

    host: str = "127.0.0.1"
    port: int = 0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    rpm: int = 0
    tpm: int = 0
    fail_after_tokens: int = 0  # a stream breaks off with the provider's mid-stream error after this many tokens
    seed: int = 0
    api_key: str = "test-key"  # the only key (or bearer token) the stand-in accepts
    max_output_tokens: int = 64  # a natural answer's length when the request allows more
    models: tuple[str, ...] = ()  # the model / deployment names served (empty: any); others answer 404


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    parser.add_argument("--tpot-ms", type=float, default=0.0, help="time per output token after the first")
    parser.add_argument("--rpm", type=int, default=0, help="requests per minute before 429 (0: unlimited)")
    parser.add_argument("--tpm", type=int, default=0, help="tokens (input + max output) per minute before 429")
    parser.add_argument("--fail-after-tokens", type=int, default=0, help="break streams with an error after N tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default="test-key", help="the key / bearer token accepted")
    parser.add_argument("--max-output-tokens", type=int, default=64, help="natural answer length")
    parser.add_argument("--models", default="", help="comma-separated model/deployment names served (default: any)")


def config_from_args(ns: argparse.Namespace) -> StandinConfig:
    return StandinConfig(
        host=ns.host,
        port=ns.port,
        ttft_ms=ns.ttft_ms,
        tpot_ms=ns.tpot_ms,
        rpm=ns.rpm,
        tpm=ns.tpm,
        fail_after_tokens=ns.fail_after_tokens,
        seed=ns.seed,
        api_key=ns.api_key,
        max_output_tokens=ns.max_output_tokens,
        models=tuple(m for m in ns.models.split(",") if m),
    )


# --- tokens and text -------------------------------------------------------------------------------

_WORDS_TEXT = (
    "the of and to in is that for it as with was on be by this are at from or have an they which one "
    "you were all we when there can more if no out so what up its about into than them only other new "
    "some time could these two may then first any like now such make over even most after also made "
    "many before back see through way where get much go well know should down work year because come "
    "people just long each those how take good great three own small right large last little still "
    "world life here both between while part under never day same another high every found old place "
    "system model data cache token engine request value result number point group order line house "
    "light water power city river field music story paper table window garden market letter question"
)
_WORDS = _WORDS_TEXT.split()


def count_tokens(text: str | bytes) -> int:
    """A provider-neutral token count: ceil(bytes / 4), at least 1 for non-empty text."""
    n = len(text.encode() if isinstance(text, str) else text)
    return math.ceil(n / 4)


class Talker:
    """Seeded answers: the same prompt and seed give the same words; each word (with its space) is one token."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def words(self, prompt_key: str | bytes, count: int) -> list[str]:
        raw = prompt_key.encode() if isinstance(prompt_key, str) else prompt_key
        digest = hashlib.blake2b(raw, digest_size=8, key=str(self.seed).encode()).digest()
        rng = random.Random(int.from_bytes(digest, "big"))
        out = [rng.choice(_WORDS) for _ in range(max(count, 0))]
        if out:
            out[0] = out[0].capitalize()
            out = [out[0]] + [" " + w for w in out[1:]]
        return out

    def length(self, prompt_key: str | bytes, limit: int, natural: int) -> int:
        """How many tokens the answer has: `natural` ± a little, never over `limit`."""
        raw = prompt_key.encode() if isinstance(prompt_key, str) else prompt_key
        digest = hashlib.blake2b(raw, digest_size=8, key=b"len" + str(self.seed).encode()).digest()
        jitter = int.from_bytes(digest, "big") % max(natural // 4 + 1, 1)
        return max(1, min(limit, natural - natural // 8 + jitter))


def sample_json(schema: Any, words: list[str]) -> Any:
    """A value of the JSON schema's shape (first enum value, every listed property), strings from `words`."""
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    if schema.get("enum"):
        return schema["enum"][0]
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: sample_json(sub, words) for name, sub in props.items()}
    if kind == "array":
        return [sample_json(schema.get("items"), words)]
    if kind == "integer":
        return len(words)
    if kind == "number":
        return len(words) / 2
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "".join(words[:3]).strip() or "value"


def split_words(text: str) -> list[str]:
    """Seeded text back into its one-token words (the first bare, the rest with their leading space)."""
    if not text:
        return []
    parts = text.split(" ")
    return [parts[0]] + [" " + p for p in parts[1:]]


# --- latency ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Latency:
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0

    async def first_token(self) -> None:
        if self.ttft_ms > 0:
            await asyncio.sleep(self.ttft_ms / 1000)

    async def next_token(self) -> None:
        if self.tpot_ms > 0:
            await asyncio.sleep(self.tpot_ms / 1000)

    async def whole(self, output_tokens: int) -> None:
        """A non-streamed answer arrives when its last token would have."""
        total = self.ttft_ms + self.tpot_ms * max(output_tokens - 1, 0)
        if total > 0:
            await asyncio.sleep(total / 1000)


# --- rate limits -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limit:
    """The window's verdict for one request, and what the provider's headers say about the window."""

    allowed: bool
    requests_limit: int  # 0: unlimited
    requests_remaining: int
    tokens_limit: int
    tokens_remaining: int
    reset_s: float  # until the oldest counted request leaves the window
    retry_after_s: float  # 0 when allowed


class RateLimiter:
    """A sliding one-minute window of requests and tokens (input + the answer's allowance, as providers count)."""

    WINDOW_S = 60.0

    def __init__(self, rpm: int = 0, tpm: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.rpm = rpm
        self.tpm = tpm
        self.clock = clock
        self._seen: deque[tuple[float, int]] = deque()

    def _expire(self, now: float) -> None:
        while self._seen and self._seen[0][0] <= now - self.WINDOW_S:
            self._seen.popleft()

    def admit(self, tokens: int) -> Limit:
        """Count the request if it fits the window, else refuse it (a refused request is not counted)."""
        now = self.clock()
        self._expire(now)
        used_requests = len(self._seen)
        used_tokens = sum(t for _, t in self._seen)
        over_r = self.rpm > 0 and used_requests + 1 > self.rpm
        over_t = self.tpm > 0 and used_tokens + tokens > self.tpm
        allowed = not (over_r or over_t)
        retry = 0.0
        if not allowed:
            retry = self._wait_for(now, over_r, tokens)
        else:
            self._seen.append((now, tokens))
            used_requests += 1
            used_tokens += tokens
        reset = (self._seen[0][0] + self.WINDOW_S - now) if self._seen else 0.0
        return Limit(
            allowed=allowed,
            requests_limit=self.rpm,
            requests_remaining=max(self.rpm - used_requests, 0) if self.rpm else 1_000_000,
            tokens_limit=self.tpm,
            tokens_remaining=max(self.tpm - used_tokens, 0) if self.tpm else 1_000_000_000,
            reset_s=max(reset, 0.0),
            retry_after_s=retry,
        )

    def _wait_for(self, now: float, over_requests: bool, tokens: int) -> float:
        """Seconds until enough of the window has left for this request to fit."""
        need_tokens = sum(t for _, t in self._seen) + tokens - self.tpm if self.tpm else 0
        need_requests = len(self._seen) + 1 - self.rpm if (over_requests and self.rpm) else 0
        freed_t = 0
        for i, (at, t) in enumerate(self._seen):
            freed_t += t
            if freed_t >= need_tokens and i + 1 >= need_requests:
                return max(at + self.WINDOW_S - now, 0.001)
        return self.WINDOW_S


# --- prompt caching --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheResult:
    read_tokens: int = 0
    write_tokens: int = 0  # written at the short (5 minute) lifetime
    write_1h_tokens: int = 0


class PromptCache:
    """Cacheable prefixes by digest: the longest one seen before (and alive) is read, the longest marked is written.

    A request names its breakpoints as (digest of the prefix up to the breakpoint, tokens up to it,
    lifetime in seconds), in prompt order. What lies between the read prefix and the last breakpoint
    is written; the part written at a breakpoint with a 1 hour lifetime counts as a 1 h write.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = 100_000) -> None:
        self.clock = clock
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # digest -> (expires, ttl)

    @staticmethod
    def digest(*parts: Any) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for part in parts:
            h.update(orjson.dumps(part, option=orjson.OPT_SORT_KEYS))
        return h.digest()

    def account(
        self, breakpoints: Iterable[tuple[bytes, int, float]], probes: Iterable[tuple[bytes, int]] = ()
    ) -> CacheResult:
        """Read the longest alive prefix among breakpoints and `probes` (earlier block boundaries a provider
        looks back over for a hit, as Anthropic does for 20 blocks), then write the breakpoints not alive."""
        now = self.clock()
        points = list(breakpoints)
        read = 0
        for key, tokens in [(k, t) for k, t, _ in points] + list(probes):
            hit = self._entries.get(key)
            if hit is not None and hit[0] > now:
                read = max(read, tokens)
                self._entries[key] = (now + hit[1], hit[1])
        write_5m = 0
        write_1h = 0
        covered = read
        for key, tokens, ttl in points:
            hit = self._entries.get(key)
            if hit is not None and hit[0] > now:
                self._entries[key] = (now + hit[1], hit[1])
                self._entries.move_to_end(key)
                continue
            self._entries[key] = (now + ttl, ttl)
            self._entries.move_to_end(key)
            if tokens > covered:
                if ttl >= 3600:
                    write_1h += tokens - covered
                else:
                    write_5m += tokens - covered
                covered = tokens
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return CacheResult(read_tokens=read, write_tokens=write_5m, write_1h_tokens=write_1h)


# --- usage tally -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Usage:
    requests: int = 0
    input_tokens: int = 0  # the whole prompt, cached parts included
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0
    reasoning_tokens: int = 0
    refused: int = 0  # 4xx / 429 answers (no tokens billed)


@dataclass(slots=True)
class UsageTally:
    """Per-model token totals, served at GET /standin/usage as {"provider", "models": {model: Usage}, "total"}."""

    provider: str = ""
    models: dict[str, Usage] = field(default_factory=dict)

    def record(self, model: str, **tokens: int) -> None:
        usage = self.models.setdefault(model, Usage())
        usage.requests += 1
        for name, value in tokens.items():
            setattr(usage, name, getattr(usage, name) + value)

    def refuse(self, model: str) -> None:
        self.models.setdefault(model, Usage()).refused += 1

    def snapshot(self) -> dict[str, Any]:
        total = Usage()
        for usage in self.models.values():
            for name, value in asdict(usage).items():
                setattr(total, name, getattr(total, name) + value)
        return {
            "provider": self.provider,
            "models": {m: asdict(u) for m, u in self.models.items()},
            "total": asdict(total),
        }


class Faults:
    """Errors queued by a test (POST /standin/faults {"status": 529, "count": 1}): the next requests fail so.

    A real provider's overloads and outages cannot be provoked on demand; the provider's handler asks
    `take()` first and answers with its own error shape for the status.
    """

    def __init__(self) -> None:
        self._queue: deque[int] = deque()

    def push(self, status: int, count: int = 1) -> None:
        self._queue.extend([status] * count)

    def take(self) -> int | None:
        return self._queue.popleft() if self._queue else None


CONFIG: web.AppKey[StandinConfig] = web.AppKey("standin_config", StandinConfig)
TALLY: web.AppKey[UsageTally] = web.AppKey("standin_tally", UsageTally)
FAULTS: web.AppKey[Faults] = web.AppKey("standin_faults", Faults)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, headers=headers, content_type="application/json")


async def _usage(request: web.Request) -> web.Response:
    return json_response(request.app[TALLY].snapshot())


async def _reset_usage(request: web.Request) -> web.Response:
    request.app[TALLY].models.clear()
    return json_response(request.app[TALLY].snapshot())


async def _faults(request: web.Request) -> web.Response:
    body = await request.json()
    request.app[FAULTS].push(int(body["status"]), int(body.get("count", 1)))
    return json_response({"queued": int(body.get("count", 1))})


async def _health(_request: web.Request) -> web.Response:
    return json_response({"ok": True})


def base_app(provider: str, cfg: StandinConfig) -> web.Application:
    """An application with the shared routes: GET /standin/health, GET / DELETE /standin/usage, POST /standin/faults."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CONFIG] = cfg
    app[TALLY] = UsageTally(provider=provider)
    app[FAULTS] = Faults()
    app.router.add_get("/standin/health", _health)
    app.router.add_get("/standin/usage", _usage)
    app.router.add_delete("/standin/usage", _reset_usage)
    app.router.add_post("/standin/faults", _faults)
    return app

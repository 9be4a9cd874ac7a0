"""A KV store shared by simulated engine processes (LMCache's remote backend, Mooncake Store), and each
engine's view of it.

`python -m sim store --port P --capacity-tokens N [--block-size 16] [--bandwidth-gbps 10] [--latency-ms 1]`
runs the store: one LRU of block hashes (`kv_cache.SharedStore`) behind a small HTTP API. Engines
started with `--kv-store-url http://HOST:P` write every block they compute to it (as LMCache stores
a request's KV once computed) and, after their own HBM and DRAM runs, load a prefix's continuation
from it at the store's link (`latency + bytes / bandwidth`, the formula the router prices) instead of
recomputing it, so a block one replica computed is a hit on every replica of the pool.

The wire (JSON; every body bounded by `MAX_BODY_BYTES` and `MAX_HASHES`, at most `MAX_FEEDS` feed
readers, each at most `FEED_QUEUE` changes behind). A test double's side channel like the engine's
`/internal/kv_pull`: it listens on loopback by default, asks no key and is not the gateway's API
(no OpenAPI entry, no gateway checklist); a deployment's store is its own product.

- `POST /put {"hashes": [...]}`: blocks an engine wrote (most recent last);
- `POST /touch {"hashes": [...], "loads": n}`: blocks an engine read (kept from eviction a while
  longer), `loads` reads counted in the store's stats;
- `GET /feed`: newline-delimited JSON, first `{"snapshot": [...]}` (what the store holds, least
  recent first) and then every change as `{"stored": [...], "removed": [...]}`;
- `GET /health`, `GET /stats` (`{"capacity_blocks", "blocks", "bandwidth", "latency_s", ...}`).

An engine keeps a mirror of the store's blocks from the feed (`RemoteStore`): its scheduler asks the
mirror, never the network, so a step is never held up by the store; the mirror is as old as the
feed's last line (a block another engine wrote a moment ago may not be seen yet, a block the store
just evicted may still be matched: the load is then charged for blocks the store no longer has, a
race real stores have too). The engine publishes what it wrote as KV events of medium `STORE` and
the store's evictions it hears of as `BlockRemoved` of medium `STORE`, which is how the gateway's
precise index learns the store of a pool with `kv_store` (docs/routing.md#kv-cache-tiers). A feed
that breaks is reconnected with backoff; its snapshot replaces the mirror.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web

from sim.kv_cache import STORE_MEDIUM, WRITE_ON_COMPUTE, KVEvent, SharedStore

log = logging.getLogger("tokenway.sim.store")

MAX_BODY_BYTES: Final = 8 << 20  # one request's hashes (a 128k-token prompt is 8k blocks)
MAX_HASHES: Final = 65_536  # per request
FEED_QUEUE: Final = 4_096  # changes waiting for one slow feed reader before it is cut off
MAX_FEEDS: Final = 256  # feed readers at once (an engine holds one); more are answered 503
RECONNECT_S: Final = (0.05, 2.0)  # the feed's reconnect backoff, first and longest


# --- the store process -----------------------------------------------------------------------------


class StoreServer:
    """The store's state and its HTTP API; `app()` to serve it."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self._feeds: set[asyncio.Queue[bytes | None]] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/put", self._put)
        app.router.add_post("/touch", self._touch)
        app.router.add_get("/feed", self._feed)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats)
        app.on_shutdown.append(self._close_feeds)
        return app

    async def _hashes(self, request: web.Request) -> tuple[list[int], dict[str, Any]]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise web.HTTPBadRequest(text=f"body is not JSON: {exc}") from exc
        hashes = body.get("hashes") if isinstance(body, dict) else None
        if not isinstance(hashes, list) or len(hashes) > MAX_HASHES or not all(type(h) is int for h in hashes):
            raise web.HTTPBadRequest(text=f"hashes: expected a list of at most {MAX_HASHES} integers")
        return hashes, body

    async def _put(self, request: web.Request) -> web.Response:
        hashes, _ = await self._hashes(request)
        self.store.put(hashes)
        self._broadcast(self.store.drain_events())
        return web.json_response({"blocks": len(self.store.blocks)})

    async def _touch(self, request: web.Request) -> web.Response:
        hashes, body = await self._hashes(request)
        blocks = self.store.blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
        loads = body.get("loads")
        if type(loads) is int and 0 < loads <= len(hashes):
            stats = self.store.stats
            stats.loads += loads
            stats.loaded_blocks += len(hashes)
        return web.json_response({})

    async def _feed(self, request: web.Request) -> web.StreamResponse:
        if len(self._feeds) >= MAX_FEEDS:
            raise web.HTTPServiceUnavailable(text=f"at most {MAX_FEEDS} feed readers")
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(FEED_QUEUE)
        response = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        await response.prepare(request)
        self._feeds.add(queue)
        try:
            await response.write(orjson.dumps({"snapshot": list(self.store.blocks)}) + b"\n")
            while (line := await queue.get()) is not None:
                await response.write(line)
        finally:
            self._feeds.discard(queue)
        return response

    def _broadcast(self, events: Sequence[KVEvent]) -> None:
        stored = [h for e in events if e.kind == "stored" for h in e.block_hashes]
        removed = [h for e in events if e.kind == "removed" for h in e.block_hashes]
        if not stored and not removed:
            return
        line = orjson.dumps({"stored": stored, "removed": removed}) + b"\n"
        for queue in list(self._feeds):
            try:
                queue.put_nowait(line)
            except asyncio.QueueFull:  # a reader this far behind reconnects and starts from a snapshot
                self._feeds.discard(queue)
                with contextlib.suppress(asyncio.QueueFull):
                    queue.get_nowait()
                    queue.put_nowait(None)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _stats(self, request: web.Request) -> web.Response:
        store, stats = self.store, self.store.stats
        return web.json_response(
            {
                "capacity_blocks": store.capacity_blocks,
                "blocks": len(store.blocks),
                "bandwidth": store.bandwidth,
                "latency_s": store.latency_s,
                "written_blocks": stats.written_blocks,
                "evicted_blocks": stats.evicted_blocks,
                "loads": stats.loads,
                "loaded_blocks": stats.loaded_blocks,
                "feeds": len(self._feeds),
            }
        )

    async def _close_feeds(self, app: web.Application) -> None:
        for queue in list(self._feeds):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)


# --- an engine's view of the store -------------------------------------------------------------------


class RemoteStore(SharedStore):
    """The store as one engine sees it: `run` and `load_s` answer from a mirror of the store's blocks
    (kept from its feed), `put` and the reads are sent to it in the background. `on_events` receives
    the `STORE` KV events this engine publishes (what it wrote, what the store evicted).

    The link (capacity, bandwidth, latency) is the store's own, read from its `/stats` each time the
    feed (re)connects; until the first connection the mirror is empty (no hit) and the defaults below
    stand. A store that is not up yet, or goes away, is waited for: the engine serves meanwhile, as
    an engine whose remote cache backend is away recomputes."""

    def __init__(
        self,
        url: str,
        bytes_per_block: int,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        *,
        capacity_blocks: int = 1,
        bandwidth_bytes_per_s: float = 10e9,
        latency_s: float = 1e-3,
    ) -> None:
        super().__init__(capacity_blocks, bandwidth_bytes_per_s, latency_s, bytes_per_block, WRITE_ON_COMPUTE)
        self.url = url.rstrip("/")
        self.on_events = on_events
        self.connected = asyncio.Event()  # the first snapshot arrived
        self._writes: list[int] = []
        self._reads: list[int] = []
        self._read_loads = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(), name="kv-store-feed"), loop.create_task(self._send())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    # what the engine's scheduler calls (no I/O)

    def put(self, hashes: Sequence[int]) -> None:
        """Blocks this engine computed: sent to the store, published as written to it."""
        if not hashes:
            return
        self._writes.extend(hashes)
        self._wake.set()
        if self.on_events is not None:
            self.on_events([KVEvent("stored", tuple(hashes), medium=STORE_MEDIUM)])

    def run(self, hashes: Sequence[int], start: int, end: int, *, touch: bool = True) -> int:
        n = super().run(hashes, start, end, touch=touch)
        if n and touch:
            self._reads.extend(hashes[start : start + n])
            self._wake.set()
        return n

    def record_load(self, num_blocks: int) -> float:
        self._read_loads += 1
        return super().record_load(num_blocks)

    # the network side

    async def _send(self) -> None:
        assert self._session is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            writes, self._writes = self._writes[:MAX_HASHES], self._writes[MAX_HASHES:]
            reads, self._reads = self._reads[:MAX_HASHES], self._reads[MAX_HASHES:]
            loads, self._read_loads = self._read_loads, 0
            if self._writes or self._reads:
                self._wake.set()
            try:
                if writes:
                    async with self._session.post(self.url + "/put", json={"hashes": writes}) as resp:
                        resp.raise_for_status()
                if reads:
                    body = {"hashes": reads, "loads": min(loads, len(reads))}
                    async with self._session.post(self.url + "/touch", json=body) as resp:
                        resp.raise_for_status()
            except (aiohttp.ClientError, TimeoutError) as exc:  # the store is away: what was sent is lost
                log.warning("kv store %s: %s", self.url, exc)
                await asyncio.sleep(RECONNECT_S[0])

    async def _follow(self) -> None:
        assert self._session is not None
        backoff = RECONNECT_S[0]
        while True:
            try:
                async with self._session.get(self.url + "/stats", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    resp.raise_for_status()
                    link = await resp.json()
                self.capacity_blocks = int(link["capacity_blocks"])
                self.bandwidth, self.latency_s = float(link["bandwidth"]), float(link["latency_s"])
                async with self._session.get(self.url + "/feed") as resp:
                    resp.raise_for_status()
                    async for line in resp.content:
                        self._apply(orjson.loads(line))
                        backoff = RECONNECT_S[0]
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
                log.info("kv store feed %s: %s; reconnecting", self.url, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_S[1])

    def _apply(self, change: dict[str, Any]) -> None:
        blocks = self.blocks
        snapshot = change.get("snapshot")
        if isinstance(snapshot, list):
            fresh: OrderedDict[int, None] = OrderedDict.fromkeys(snapshot)
            gone = [h for h in blocks if h not in fresh]
            self.blocks = fresh
            self.connected.set()
            self._publish_removed(gone)
            return
        for h in change.get("stored") or ():
            blocks[h] = None
            blocks.move_to_end(h)
        removed = [h for h in change.get("removed") or () if blocks.pop(h, 0) is None]
        self._publish_removed(removed)

    def _publish_removed(self, removed: list[int]) -> None:
        if removed and self.on_events is not None:
            self.on_events([KVEvent("removed", tuple(removed), medium=STORE_MEDIUM)])


# --- the command line --------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    """`python -m sim store ...` (see the module docstring)."""
    from backends.perf.presets import resolve_preset
    from backends.perf.roofline import kv_bytes_per_token_per_device

    p = argparse.ArgumentParser(prog="tokenway sim store", description="A KV store shared by simulated engines.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--capacity-tokens", type=int, required=True, help="tokens of KV it holds (LRU)")
    p.add_argument("--block-size", type=int, default=16, help="the engines' KV block size in tokens")
    p.add_argument("--bandwidth-gbps", type=float, default=10.0, help="GB/s per device of loading from it")
    p.add_argument("--latency-ms", type=float, default=1.0, help="fixed cost of one load, ms")
    p.add_argument("--preset", default="llama-3.1-8b@h100", help="the engines' preset (KV bytes per token)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    try:
        per_block = args.block_size * kv_bytes_per_token_per_device(resolve_preset(args.preset))
        store = SharedStore(
            max(args.capacity_tokens // args.block_size, 1),
            args.bandwidth_gbps * 1e9,
            args.latency_ms / 1e3,
            per_block,
            WRITE_ON_COMPUTE,
        )
    except (ValueError, KeyError) as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return 1
    print(f"tokenway-sim store on http://{args.host}:{args.port}", flush=True)
    web.run_app(StoreServer(store).app(), host=args.host, port=args.port, print=None)
    return 0

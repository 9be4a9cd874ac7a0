"""The console's overview and live tail across every replica (and every worker of `--workers N`).

Each gateway process keeps its own last hour and newest requests (activity.py); behind a load
balancer the console would show the third of the traffic that reached the replica it asked. With
shared state (`state: redis`, or the private Redis of a worker group) each process publishes its
minute counters and newest rows every `interval_s` to one Redis key of its own that expires after
`ttl_s`, and lists itself in a sorted set scored by the time; `GET /admin/activity` reads the live
ones (at most `MAX_REPLICAS`), sums the minutes and merges the tails newest first, each row naming
its replica. This process's own part is always read live, so what it just served shows at once;
the others' lag by at most `interval_s`. A replica that stops publishing drops out after `ttl_s`.
Memory and Redis stay bounded: one snapshot per live replica, `TAIL_ROWS` rows each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
import redis.asyncio as redis

from backends.tasks import cancel_and_wait
from gateway.console.activity import ConsoleActivity, overview_of, summed

log = logging.getLogger(__name__)

TAIL_ROWS = 100
MAX_REPLICAS = 64


class SharedActivity:
    def __init__(
        self,
        activity: ConsoleActivity,
        redis_url: str,
        prefix: str,
        name: str,
        *,
        interval_s: float = 2.0,
        ttl_s: float = 10.0,
    ) -> None:
        self.activity = activity
        self.name = name
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        tag = "{" + prefix + "}:console:"
        self._members = tag + "replicas"
        self._key = tag + "activity:"
        self._task: asyncio.Task[None] | None = None
        self.errors = 0

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._publish_loop())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], what="console activity")
        with contextlib.suppress(Exception):
            await self._client.zrem(self._members, self.name)
        await self._client.aclose()

    async def _publish_loop(self) -> None:
        while True:
            try:
                await self.publish()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the console shows this replica alone meanwhile
                self.errors += 1
                log.debug("console activity not shared: %s", exc)
            await asyncio.sleep(self.interval_s)

    def _snapshot(self) -> dict[str, Any]:
        return {"minutes": self.activity.minutes(), "tail": self.activity.tail(limit=TAIL_ROWS)}

    async def publish(self) -> None:
        now_s = time.time()
        blob = orjson.dumps(self._snapshot())
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.set(self._key + self.name, blob, px=int(self.ttl_s * 1000))
            pipe.zadd(self._members, {self.name: now_s})
            pipe.zremrangebyscore(self._members, "-inf", now_s - self.ttl_s)
            pipe.pexpire(self._members, int(self.ttl_s * 6000))
            await pipe.execute()

    async def merged(self, limit: int = 100, keep: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        """The overview and tail of every live replica, this one's read live; this one's alone when
        Redis does not answer (with `replicas_unavailable` saying so). The tail holds only the rows
        `keep` keeps (a team admin's), counted before `limit`."""
        now_s = time.time()
        own = self._snapshot()
        parts: list[tuple[str, dict[str, Any]]] = [(self.name, own)]
        unavailable = False
        try:
            names = await self._client.zrangebyscore(
                self._members, now_s - self.ttl_s, "+inf", start=0, num=MAX_REPLICAS
            )
            others = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
            others = [n for n in others if n != self.name]
            blobs = await self._client.mget([self._key + n for n in others]) if others else []
            for name, blob in zip(others, blobs, strict=True):
                if blob:
                    parts.append((name, orjson.loads(blob)))
        except Exception as exc:
            self.errors += 1
            unavailable = True
            log.debug("console activity of other replicas unavailable: %s", exc)
        by_minute: dict[int, dict[str, Any]] = {}
        rows: list[dict[str, Any]] = []
        for name, part in parts:
            for minute in part.get("minutes") or ():
                into = by_minute.get(minute["t"])
                if into is None:
                    by_minute[minute["t"]] = dict(minute)
                else:
                    for field, value in minute.items():
                        if field != "t":
                            into[field] = summed(into.get(field), value)
            rows.extend(
                {**row, "replica": name, "seq": int(row["ts"] * 1e6)}
                for row in part.get("tail") or ()
                if keep is None or keep(row)
            )
        rows.sort(key=lambda r: r["ts"], reverse=True)
        found = overview_of(list(by_minute.values()), now_s)
        found["tail"] = rows[:limit]
        found["replicas"] = [name for name, _ in parts]
        if unavailable:
            found["replicas_unavailable"] = True
        return found

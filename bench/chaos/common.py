"""Shared by the chaos probes: a gateway over simulated engines (real processes), a Redis the probe can
stop, kill and restart, a load generator that remembers what every client saw, and readers for what
the gateway recorded (ledger, /admin/status, /admin/backends) and what Redis still holds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
import redis
from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gateway.ledger.reader import iter_entries  # noqa: E402
from policies.policy import hash_key  # noqa: E402
from tests.support.procs import (  # noqa: E402
    Gateway,
    SimEngines,
    free_port,
    http_get,
    redis_argv,
    start_gateway,
    start_sim,
    static_pool,
    stop_process,
    wait_redis,
)

RESULTS = REPO / "bench" / "results"
KEY = "sk-chaos-bench-0001"
ADMIN = "chaos-admin-token"
MODEL = "llama-3.1-8b"
PREFIX = "chaos"


def policies(
    limits: list[dict[str, Any]], budgets: list[dict[str, Any]] | None = None, **admission: Any
) -> dict[str, Any]:
    return {
        "admission": admission,
        "tenants": {"bench": {}},
        "keys": [{"id": "bench", "tenant": "bench", "sha256": hash_key(KEY)}],
        "models": {
            MODEL: {
                "context_length": 16384,
                "default_max_tokens": 64,
                "price": {"input_per_mtok": 1.0, "cached_input_per_mtok": 0.1, "output_per_mtok": 4.0},
            }
        },
        "limits": limits,
        "budgets": budgets or [],
    }


class OwnRedis:
    """redis-server on a free port that the probe may SIGSTOP, SIGKILL and restart (same port and data
    directory; `aof` keeps every write, so a restart after kill -9 comes back with all of it)."""

    def __init__(self, workdir: Path, *, aof: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is required")
        self.binary = binary
        self.port = free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True)
        self.aof = aof
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = redis_argv(self.binary, self.port, self.dir)
        if self.aof:
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_redis(self.url)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            stop_process(self.proc)
        self.proc = None

    def leftovers(self) -> dict[str, float]:
        """What the limiter still holds in Redis: open tickets, unexpired leases, budget spend (USD)."""
        client = self.client()
        tag = "{" + PREFIX + "}:"
        now = float(client.time()[0])
        leases = sum(int(client.zcount(k, f"({now}", "+inf")) for k in client.scan_iter(match=tag + "c:*"))
        tickets = int(client.zcount(tag + "tickets", f"({now}", "+inf"))
        spend = sum(float(client.hget(k, "s") or 0.0) for k in client.scan_iter(match=tag + "u:*"))
        return {"tickets": tickets, "leases": leases, "budget_usd": spend}


@dataclass
class Stack:
    """Simulated engines (one process each, so one can be killed) and the gateway in front of them."""

    workdir: Path
    engines: list[SimEngines]
    gateway: Gateway

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.gateway.stop()
        for engine in self.engines:
            with contextlib.suppress(Exception):
                engine.stop()

    @property
    def ledger_dir(self) -> Path:
        return self.workdir / "usage"

    def records(self) -> list[dict[str, Any]]:
        return list(iter_entries(self.ledger_dir)) if self.ledger_dir.exists() else []

    def admin(self, path: str) -> Any:
        status, body = http_get(self.gateway.url + path, {"Authorization": f"Bearer {ADMIN}"}, timeout_s=10)
        if status != 200:
            raise RuntimeError(f"{path}: {status} {body[:200]}")
        return orjson.loads(body)

    def open_leases(self) -> int:
        """Concurrency leases the gateway's limiter holds (memory store: /admin/status)."""
        rows = self.admin("/admin/status")["limits"]
        return sum(int(r.get("active", 0)) for r in rows if r.get("kind") == "concurrency")

    def inflight(self) -> int:
        pools = self.admin("/admin/backends")["pools"]
        return sum(int(e["inflight_requests"]) for p in pools for e in p["endpoints"])

    def pending_store_ops(self) -> int:
        status = self.admin("/admin/status")["admission"]
        return int(status.get("pending_settlements", 0)) + int(status.get("pending_voids", 0))

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.gateway.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def start_stack(
    workdir: Path,
    *,
    engines: int = 2,
    time_scale: float = 10.0,
    policy: dict[str, Any] | None = None,
    pools: Callable[[list[str]], list[dict[str, Any]]] | None = None,
    sim_args: tuple[str, ...] = (),
    **sections: Any,
) -> Stack:
    """`engines` simulated engines and a gateway; `pools(urls)` lays the engines out in pools (default:
    one pool of all of them)."""
    workdir.mkdir(parents=True, exist_ok=True)
    sims = [
        start_sim(workdir, count=1, served_model_name=MODEL, time_scale=time_scale, args=sim_args)
        for _ in range(engines)
    ]
    server = {"admin_token": ADMIN, **sections.pop("server", {})}
    ledger = {"dir": str(workdir / "usage"), **sections.pop("ledger", {})}
    try:
        gateway = start_gateway(
            workdir / "gw",
            pools=(pools or _one_pool)([s.urls[0] for s in sims]),
            policies=policy or policies([]),
            server=server,
            ledger=ledger,
            **sections,
        )
    except Exception:
        for sim in sims:
            sim.stop()
        raise
    return Stack(workdir, sims, gateway)


def _one_pool(urls: list[str]) -> list[dict[str, Any]]:
    return [static_pool("llama", MODEL, urls)]


@contextlib.contextmanager
def running(stack: Stack) -> Iterator[Stack]:
    try:
        yield stack
    finally:
        stack.stop()


@dataclass
class Outcome:
    """What one client saw."""

    request_id: str
    stream: bool
    status: int = 0  # 0: no HTTP answer (connection error)
    complete: bool = False  # a whole answer arrived (200 and, for streams, [DONE] without an error event)
    error: str = ""
    finished_at_unix_s: float = 0.0
    body: dict[str, Any] = field(default_factory=dict)


def batch_lines(request_id: str, n: int = 3) -> bytes:
    """A batch input file of `n` short chat lines, their custom ids made from `request_id`."""
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"{request_id}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            }
        )
        + b"\n"
        for i in range(n)
    )


def chat_body(stream: bool, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    words = " ".join(f"w{random.randrange(10_000)}" for _ in range(random.randint(5, 60)))
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": max_tokens,
        **extra,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def send(
    session: aiohttp.ClientSession, base_url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Outcome:
    request_id = uuid.uuid4().hex
    stream = bool(body.get("stream"))
    out = Outcome(request_id, stream)
    all_headers = {"Authorization": f"Bearer {KEY}", "x-request-id": request_id, **(headers or {})}
    try:
        async with session.post(base_url + "/v1/chat/completions", json=body, headers=all_headers) as response:
            out.status = response.status
            raw = await response.read()
            if response.status == 200 and stream:
                out.complete = b"data: [DONE]" in raw and b'data: {"error"' not in raw
                if not out.complete:
                    out.error = "stream broken" if b'data: {"error"' in raw else "stream cut"
            elif response.status == 200:
                out.complete = True
            else:
                with contextlib.suppress(orjson.JSONDecodeError):
                    out.body = orjson.loads(raw)
                out.error = str((out.body.get("error") or {}).get("code") or response.status)
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.error = type(exc).__name__
    out.finished_at_unix_s = time.time()
    return out


async def paced(count_per_s: float, duration_s: float, make: Any) -> list[Outcome]:
    """Open-loop load: start `make()` (a coroutine) at `count_per_s` for `duration_s`; every result."""
    tasks: list[asyncio.Task[Outcome]] = []
    start = time.monotonic()
    n = 0
    while True:
        due = start + n / count_per_s
        now = time.monotonic()
        if due - start >= duration_s:
            break
        if due > now:
            await asyncio.sleep(due - now)
        tasks.append(asyncio.ensure_future(make()))
        n += 1
    return list(await asyncio.gather(*tasks))


def session(total_s: float = 120.0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=total_s),
    )


# What the gateway logs when a request met a bug rather than a refusal: the walk's catch-all
# (gateway/request/director.py), aiohttp's own, the bounded-bodies middleware's (a handler's bug,
# answered 500: gateway/http/bodies.py), gRPC's for a servicer that raised (`tokenway epp`), and the replicas'
# reader's for a stream entry that met a bug (gateway/replicas/bus.py).
UNEXPECTED_IN_LOG = (
    "failed unexpectedly",
    "Error handling request",
    "unhandled error answering",
    "raised by servicer method",
    "failed to apply",
)


def unexpected_errors(log: str) -> int:
    """How many times the gateway's log says a request met a bug (`UNEXPECTED_IN_LOG`)."""
    return sum(log.count(marker) for marker in UNEXPECTED_IN_LOG)


def held(base_url: str, headers: dict[str, str] | None = None) -> tuple[int, int]:
    """(lease tickets active, requests in flight on the endpoints) of a gateway, from its admin API
    (`headers`: its admin credentials, where it has any); what a probe must find at 0 afterwards."""

    def admin(path: str) -> Any:
        status, body = http_get(base_url + path, headers or {}, timeout_s=10)
        return orjson.loads(body) if status == 200 else {}

    leases = sum(int(r.get("active", 0)) for r in admin("/admin/status").get("limits", []) if r.get("kind") == "lease")
    pools = admin("/admin/backends").get("pools", [])
    return leases, sum(int(e["inflight_requests"]) for p in pools for e in p["endpoints"])


def ledger_tally(ledger: Path, prefix: str) -> tuple[dict[str, int], int]:
    """The records of a ledger whose request id starts with `prefix`: how many each id has, and how
    many hold a negative token count or cost (billing must never refund what an answer claimed)."""
    time.sleep(0.5)  # the ledger's last batch
    counts: dict[str, int] = {}
    negative = 0
    for record in iter_entries(ledger) if ledger.exists() else []:
        request_id = str(record.get("request_id", ""))
        if request_id.startswith(prefix):
            counts[request_id] = counts.get(request_id, 0) + 1
            negative += any((record.get(k) or 0) < 0 for k in ("input_tokens", "output_tokens", "cost_usd"))
    return counts, negative


def until(condition: Any, timeout_s: float = 60.0, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if condition():
                return True
        time.sleep(interval_s)
    return False


_Test = TypeVar("_Test", bound=Callable[..., Any])


def fuzz_settings(examples: int, seed: int | None = None) -> Callable[[_Test], _Test]:
    """Hypothesis settings of the fuzz stages, as a decorator: a fixed number of examples, no example
    database, no deadline (the gateway is a real process on a busy host). Without `seed` the examples
    are the same every run (derandomized), so a run is comparable with the last; a `seed` draws
    another sequence, which is how a probe reaches inputs the fixed one never generates (a hole found
    that way then gets a check of its own in `checklist.py`)."""
    chosen = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=list(HealthCheck),
    )

    def apply(test: _Test) -> _Test:
        test = chosen(test)
        return test if seed is None else hypothesis_seed(seed)(test)

    return apply


def examples_block(examples: list[str], limit: int = 400) -> list[str]:
    """A section's failing examples as an indented block (each cut at `limit` characters), with the
    blank line that ends it; nothing where there are none."""
    lines = [f"    {example[:limit]}" for example in examples]
    return [*lines, ""] if lines else []

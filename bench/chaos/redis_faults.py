"""Probe: the shared limiter's Redis stalls (SIGSTOP / SIGCONT) and crashes (`kill -9`, restarted with
its append-only file) under load, with `fail_open` and with `fail_closed`.

The gateway keeps its limits, a concurrency limit and a USD budget in a Redis the probe owns. Five
0.5 s stalls (commands sent meanwhile run when Redis resumes, after the gateway's 100 ms timeout: the
ambiguous case), then one crash and restart. Afterwards every request has finished: Redis must hold
no ticket and no lease, and the budget it kept must equal what the ledger says the requests cost.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from bench.chaos.common import (
    PREFIX,
    Outcome,
    OwnRedis,
    chat_body,
    paced,
    policies,
    running,
    send,
    session,
    start_stack,
    until,
)

STALLS = 5
STALL_S = 0.5


def run(workdir: Path, store_failure: str, *, rate_per_s: float = 60.0, crash: bool = True) -> dict[str, Any]:
    server = OwnRedis(workdir, aof=True)
    policy = policies(
        [{"scope": "key", "tpm": 50_000_000, "max_concurrent": 2000}],
        [{"scope": "tenant", "usd_per_day": 1000.0}],
        store_failure=store_failure,
    )
    state = {"backend": "redis", "redis_url": server.url, "key_prefix": PREFIX}
    try:
        stack = start_stack(workdir / "stack", engines=2, time_scale=10.0, policy=policy, state=state)
    except Exception:
        server.stop()
        raise
    faults: list[str] = []
    with running(stack):

        def inject() -> None:
            time.sleep(1.5)
            for _ in range(STALLS):
                server.signal(signal.SIGSTOP)
                time.sleep(STALL_S)
                server.signal(signal.SIGCONT)
                faults.append("stall")
                time.sleep(1.5)
            if crash:
                server.kill()
                faults.append("kill -9")
                time.sleep(1.0)
                server.start()
                faults.append("restart")

        injector = threading.Thread(target=inject)
        duration_s = 1.5 + STALLS * (STALL_S + 1.5) + (3.0 if crash else 0.0) + 2.0

        async def load() -> list[Outcome]:
            async with session() as http:
                injector.start()
                return await paced(
                    rate_per_s, duration_s, lambda: send(http, stack.gateway.url, chat_body(random.random() < 0.3))
                )

        outcomes = asyncio.run(load())
        injector.join()
        drained = until(lambda: stack.pending_store_ops() == 0, timeout_s=60)
        time.sleep(0.5)
        left = server.leftovers()
        until(lambda: len(stack.records()) >= len(outcomes), timeout_s=30)
        records = stack.records()
    server.stop()
    ledger_usd = sum(float(r.get("cost_usd") or 0.0) for r in records)
    failed: dict[str, int] = {}
    for o in outcomes:
        if not o.complete:
            failed[o.error or str(o.status)] = failed.get(o.error or str(o.status), 0) + 1
    return {
        "store_failure": store_failure,
        "faults": faults,
        "sent": len(outcomes),
        "served": sum(1 for o in outcomes if o.complete),
        "failed": failed,
        "records": len(records),
        "tickets_left": left["tickets"],
        "leases_left": left["leases"],
        "budget_usd": left["budget_usd"],
        "ledger_usd": ledger_usd,
        "replay_drained": drained,
    }

"""Probe: `kill -9` of the gateway under load; what clients saw complete vs what the ledger kept.

Clients send with their own request ids; a few seconds in the gateway is killed. The ledger writes a
group of records every `commit_interval_ms`: a request whose answer the client had received more
than one interval before the kill must have its record on disk; those within the last interval may
be lost (they were still in memory).
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from bench.chaos.common import Outcome, chat_body, paced, policies, running, send, session, start_stack

COMMIT_INTERVAL_MS = 100


def run(workdir: Path, *, rate_per_s: float = 60.0, kill_at_s: float = 5.0) -> dict[str, Any]:
    stack = start_stack(
        workdir,
        engines=2,
        time_scale=10.0,
        policy=policies([]),
        ledger={"commit_interval_ms": COMMIT_INTERVAL_MS},
    )
    killed_at: list[float] = []
    with running(stack):

        def kill() -> None:
            time.sleep(kill_at_s)
            killed_at.append(time.time())
            stack.gateway.proc.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill)

        async def load() -> list[Outcome]:
            async with session(30) as http:
                killer.start()
                return await paced(
                    rate_per_s, kill_at_s + 1.0, lambda: send(http, stack.gateway.url, chat_body(random.random() < 0.3))
                )

        outcomes = asyncio.run(load())
        killer.join()
        stack.gateway.proc.wait(10)
        recorded = {r["request_id"] for r in stack.records()}
    kill_s = killed_at[0]
    complete = [o for o in outcomes if o.complete]
    settled_before = [o for o in complete if o.finished_at_unix_s < kill_s - COMMIT_INTERVAL_MS / 1000.0]
    last_interval = [o for o in complete if o.finished_at_unix_s >= kill_s - COMMIT_INTERVAL_MS / 1000.0]
    return {
        "sent": len(outcomes),
        "complete": len(complete),
        "complete_before_last_interval": len(settled_before),
        "lost_before_last_interval": sum(1 for o in settled_before if o.request_id not in recorded),
        "complete_in_last_interval": len(last_interval),
        "lost_in_last_interval": sum(1 for o in last_interval if o.request_id not in recorded),
        "records": len(recorded),
        "commit_interval_ms": COMMIT_INTERVAL_MS,
    }

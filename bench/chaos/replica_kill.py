"""Probe: `kill -9` of one engine replica under mixed streamed / non-streamed load.

Two simulated engines (separate processes) behind one gateway; clients send at a steady rate, half of
them streamed; a few seconds in, one engine is killed. A non-streamed request caught on it has sent
nothing to its client yet, so the gateway retries it elsewhere: none should fail. A stream already
relaying tokens cannot move (its client has part of an answer): those end with an error event.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from bench.chaos.common import Outcome, chat_body, paced, policies, running, send, session, start_stack, until


def run(workdir: Path, *, rate_per_s: float = 30.0, duration_s: float = 12.0, kill_at_s: float = 4.0) -> dict[str, Any]:
    policy = policies([{"scope": "key", "max_concurrent": 10_000}])
    stack = start_stack(workdir, engines=2, time_scale=2.0, policy=policy)
    with running(stack):
        victim = stack.engines[0]

        def kill() -> None:
            time.sleep(kill_at_s)
            victim.proc.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill)

        async def load() -> list[Outcome]:
            async with session() as http:
                killer.start()
                return await paced(
                    rate_per_s,
                    duration_s,
                    lambda: send(http, stack.gateway.url, chat_body(random.random() < 0.5, max_tokens=96)),
                )

        outcomes = asyncio.run(load())
        killer.join()
        until(lambda: stack.open_leases() == 0 and stack.inflight() == 0, timeout_s=30)
        leases, inflight = stack.open_leases(), stack.inflight()
    rows: dict[str, Any] = {}
    for kind, stream in (("non-streamed", False), ("streamed", True)):
        mine = [o for o in outcomes if o.stream is stream]
        failed = [o for o in mine if not o.complete]
        reasons: dict[str, int] = {}
        for o in failed:
            reasons[o.error or str(o.status)] = reasons.get(o.error or str(o.status), 0) + 1
        rows[kind] = {"sent": len(mine), "failed": len(failed), "reasons": reasons}
    return {"rows": rows, "leases_left": leases, "inflight_left": inflight, "rate_per_s": rate_per_s,
            "duration_s": duration_s, "kill_at_s": kill_at_s}  # fmt: skip

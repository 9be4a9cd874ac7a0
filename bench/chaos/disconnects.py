"""Probe: clients that disconnect at random points, the PD prefill leg included.

A prefill/decode pool (two simulated engines with KV transfer) at real time: long prompts are
prefilled on one engine, then decoded on the other. Each client gives up after a random delay
(anywhere from before admission to after the answer), some streamed, some not. Afterwards
nothing may be held: no concurrency lease in the limiter, no in-flight count on an endpoint, and
exactly one ledger record per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from pathlib import Path
from typing import Any

from bench.chaos.common import KEY, MODEL, policies, running, start_stack, unexpected_errors, until
from tests.support.procs import metric_total

KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
GIVE_UP_S = 3.0


def _long_prompt() -> str:
    tag = uuid.uuid4().hex[:6]
    return " ".join(f"{tag}-{i}" for i in range(random.randint(400, 900)))


async def _client(port: int, give_up_s: float) -> tuple[str, str]:
    """(request id, what happened: 'complete' | 'gave-up' | error). The request is written whole
    first (so the gateway has it), then the client waits up to `give_up_s` and closes its socket."""
    request_id = uuid.uuid4().hex
    stream = random.random() < 0.5
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": _long_prompt()}], "max_tokens": 64}
    if stream:
        body["stream"] = True
    raw = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nx-request-id: {request_id}\r\nConnection: close\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + raw)
    await writer.drain()

    async def answer() -> bytes:
        return await reader.read()  # until the gateway closes (Connection: close)

    try:
        data = await asyncio.wait_for(answer(), timeout=give_up_s)
    except TimeoutError:
        return request_id, "gave-up"
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    while data.startswith(b"HTTP/1.1 1"):  # interim answers
        data = data.split(b"\r\n\r\n", 1)[1]
    return request_id, "complete" if data.startswith(b"HTTP/1.1 200") else data[:12].decode(errors="replace")


def run(workdir: Path, *, clients: int = 160, concurrency: int = 16) -> dict[str, Any]:
    args = ("--kv-transfer-config", json.dumps(KV_TRANSFER))

    def pd_pool(urls: list[str]) -> list[dict[str, Any]]:
        endpoints = [{"url": urls[0], "role": "prefill"}, {"url": urls[1], "role": "decode"}]
        return [{"name": "pd", "model": MODEL, "engine": "vllm", "endpoints": endpoints}]

    stack = start_stack(
        workdir,
        engines=2,
        time_scale=1.0,
        policy=policies([{"scope": "key", "max_concurrent": 10_000}]),
        sim_args=args,
        pools=pd_pool,
    )
    outcomes: list[tuple[str, str]] = []
    with running(stack):

        async def load() -> None:
            gate = asyncio.Semaphore(concurrency)

            async def one() -> None:
                async with gate:
                    outcomes.append(await _client(stack.gateway.port, random.uniform(0.0, GIVE_UP_S)))

            await asyncio.gather(*(one() for _ in range(clients)))

        asyncio.run(load())
        settled = until(lambda: stack.open_leases() == 0 and stack.inflight() == 0, timeout_s=60)
        leases, inflight = stack.open_leases(), stack.inflight()
        until(lambda: len(stack.records()) >= clients, timeout_s=30)
        time.sleep(0.5)
        records = stack.records()
        log = stack.gateway.log()
        prefill_legs = int(metric_total(stack.engines[0].urls[0], "vllm:request_success_total"))
    by_id: dict[str, int] = {}
    for record in records:
        by_id[record["request_id"]] = by_id.get(record["request_id"], 0) + 1
    kinds: dict[str, int] = {}
    for _, what in outcomes:
        kinds[what] = kinds.get(what, 0) + 1
    return {
        "clients": clients,
        "outcomes": kinds,
        "leases_left": leases,
        "inflight_left": inflight,
        "settled": settled,
        "records": len(records),
        "missing_records": sum(1 for rid, _ in outcomes if rid not in by_id),
        "duplicate_records": sum(1 for n in by_id.values() if n > 1),
        "statuses": _count(r.get("status", "") for r in records),
        "prefill_legs": prefill_legs,
        "internal_errors": unexpected_errors(log),
    }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out

"""One replica of the accuracy benchmark: open-loop Poisson arrivals against a shared-Redis TPM limit.

Prints one JSON line: for every admitted request, (admit wall time, actual tokens), the count of
rejections, and the wall time the arrivals ended. Usage is below the reservation, so settle refunds, as in production.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import redis.asyncio as aioredis

from bench.limiter.common import KEY
from policies.limits.admission import Admission, Admitted
from policies.limits.failover import FailoverStore
from policies.limits.redis_store import RedisStore
from policies.loader import load_policy
from policies.types import RequestFacts, Usage


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--rate", type=float, required=True, help="this replica's offered requests/s")
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    policy = load_policy(args.policy)
    who = policy.authenticate(KEY)
    assert who is not None
    rng = random.Random(args.seed)
    admission = Admission(policy, FailoverStore(RedisStore.from_url(args.redis, prefix=args.prefix, timeout_s=1.0)))
    admitted: list[tuple[float, int]] = []
    rejected = 0
    tasks: set[asyncio.Task[None]] = set()

    async def one(prompt: int, max_tokens: int, completion: int) -> None:
        nonlocal rejected
        facts = RequestFacts(
            request_id="b",
            api="chat",
            body={},
            requested_model="m",
            model="m",
            principal=who,
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            output_reservation=max_tokens,
        )
        result = await admission.admit(facts, "m")
        if not isinstance(result, Admitted):
            rejected += 1
            return
        admitted.append((time.time(), prompt + completion))
        await asyncio.sleep(0.02 + rng.random() * 0.18)  # the upstream call
        admission.settle_soon(result, Usage(prompt, completion), model="m")  # as the gateway does: not awaited

    control = aioredis.Redis.from_url(args.redis, socket_timeout=None)  # BLPOP waits longer than the default
    await control.lpush(f"{args.prefix}:ready", args.seed)
    await control.blpop([f"{args.prefix}:go"], timeout=120)
    start = time.monotonic()
    next_at = start
    while True:
        next_at += rng.expovariate(args.rate)
        delay = next_at - time.monotonic()
        if next_at - start >= args.duration:
            ended_at = time.time() + max(0.0, delay)
            break
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.get_running_loop().create_task(one(rng.randint(200, 800), 256, rng.randint(32, 256)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    await control.aclose()
    await admission.close()
    sys.stdout.write(json.dumps({"admitted": admitted, "rejected": rejected, "ended_at": ended_at}) + "\n")


if __name__ == "__main__":
    asyncio.run(main())

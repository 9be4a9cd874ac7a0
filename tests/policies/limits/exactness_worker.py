"""One "gateway replica" of the exactness test: C concurrent clients doing admit -> work -> settle
against a shared Redis. Prints one JSON line: every admitted request's (reserved, actual) tokens."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from typing import Any

import redis.asyncio as aioredis

from policies.limits.admission import Admission, Admitted
from policies.limits.failover import FailoverStore
from policies.limits.redis_store import RedisStore
from policies.loader import load_policy
from policies.types import RequestFacts, Usage

Results = dict[str, list[Any]]


async def client(adm: Admission, facts_for: list[RequestFacts], rng: random.Random, out: Results) -> None:
    for facts in facts_for:
        result = await adm.admit(facts, "big")
        if not isinstance(result, Admitted):
            out["rejected"].append(result.code)
            await asyncio.sleep(0.001)
            continue
        await asyncio.sleep(rng.random() * 0.003)
        # the estimate is off by a few tokens, the completion stops anywhere up to max_tokens
        prompt = max(1, facts.prompt_tokens + rng.randint(-2, 2))
        completion = rng.randint(0, facts.output_reservation)
        await adm.settle(result, Usage(prompt_tokens=prompt, completion_tokens=completion), model="big")
        out["admitted"].append([facts.prompt_tokens + facts.output_reservation, prompt + completion])


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--requests", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    policy = load_policy(args.policy)
    who = policy.authenticate("sk-exactness")
    assert who is not None
    rng = random.Random(args.seed)
    store = FailoverStore(RedisStore.from_url(args.redis, prefix=args.prefix, timeout_s=5.0))
    adm = Admission(policy, store)
    plans = []
    for c in range(args.clients):
        plan = []
        for r in range(args.requests):
            max_tokens = rng.randint(50, 400)
            plan.append(
                RequestFacts(
                    request_id=f"{args.seed}-{c}-{r}",
                    api="chat",
                    body={},
                    requested_model="big",
                    model="big",
                    principal=who,
                    prompt_tokens=rng.randint(50, 300),
                    max_tokens=max_tokens,
                    output_reservation=max_tokens,
                )
            )
        plans.append(plan)
    out: Results = {"admitted": [], "rejected": []}
    control = aioredis.Redis.from_url(args.redis, socket_timeout=120)  # blpop below waits up to 60 s
    await control.lpush(f"{args.prefix}:ready", args.seed)
    await control.blpop([f"{args.prefix}:go"], timeout=60)
    await asyncio.gather(*(client(adm, plan, random.Random(args.seed * 1000 + i), out) for i, plan in enumerate(plans)))
    await control.aclose()
    await adm.close()
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    asyncio.run(main())

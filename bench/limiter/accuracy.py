"""(a) Accuracy: N replicas (processes) share one Redis TPM limit under 3x overload for a fixed time.

The bucket is exhausted (a full minute's tokens used) the moment the replicas start, so every token
admitted during the run is refill: the ideal is exactly TPM x window / 60, the window running from
that moment to the end of the last replica's arrivals (wall clock; all processes share one host).
Reported: admitted tokens per minute (real usage, after refunds) / configured TPM. Target <= 1.01.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import yaml

from bench.limiter.common import KEY, REPO, RedisServer, policy_doc
from policies.limits.admission import Admission, Admitted
from policies.limits.failover import FailoverStore
from policies.limits.redis_store import RedisStore
from policies.loader import load_policy
from policies.types import RequestFacts, Usage

MEAN_ACTUAL_TOKENS = (200 + 800) / 2 + (32 + 256) / 2  # what the workers' request mix uses on average


async def exhaust_and_go(url: str, prefix: str, policy_path: Path, tpm: int, replicas: int) -> float:
    """Use up the whole bucket (one settled request of exactly TPM tokens), then release the replicas.
    Returns the wall time the bucket was exhausted."""
    policy = load_policy(policy_path)
    who = policy.authenticate(KEY)
    assert who is not None
    admission = Admission(policy, FailoverStore(RedisStore.from_url(url, prefix=prefix)))
    facts = RequestFacts(
        request_id="x",
        api="chat",
        body={},
        requested_model="m",
        model="m",
        principal=who,
        prompt_tokens=tpm - 1,
        max_tokens=1,
        output_reservation=1,
    )
    started_at = time.time()
    ticket = await admission.admit(facts, "m")
    assert isinstance(ticket, Admitted), ticket
    await admission.settle(ticket, Usage(tpm - 1, 1), model="m")
    control = redis.asyncio.Redis.from_url(url)
    await control.lpush(f"{prefix}:go", *[1] * replicas)
    await control.aclose()
    await admission.close()
    return started_at


def run(
    replicas: int,
    *,
    tpm: int,
    duration_s: float,
    overload: float,
    workdir: Path,
    server: RedisServer,
    precheck: bool = True,
) -> dict[str, Any]:
    prefix = f"bench-accuracy-{replicas}-{precheck}-{int(time.time())}"
    doc = policy_doc([{"scope": "key", "tpm": tpm}], admission={"replicas": replicas, "local_precheck": precheck})
    policy_path = workdir / f"policies-{replicas}.yaml"
    policy_path.write_text(yaml.safe_dump(doc))
    offered_rps = overload * tpm / 60 / MEAN_ACTUAL_TOKENS
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.limiter.accuracy_worker",
                "--redis",
                server.url,
                "--prefix",
                prefix,
                "--policy",
                str(policy_path),
                "--rate",
                str(offered_rps / replicas),
                "--duration",
                str(duration_s),
                "--seed",
                str(i + 1),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(replicas)
    ]
    control = redis.Redis.from_url(server.url, socket_timeout=None)  # BLPOP waits longer than the default
    for _ in procs:
        if control.blpop([f"{prefix}:ready"], timeout=120) is None:
            raise RuntimeError("a worker did not start")
    started_at = asyncio.run(exhaust_and_go(server.url, prefix, policy_path, tpm, replicas))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=duration_s + 120)
        if proc.returncode != 0:
            raise RuntimeError(err.decode())
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    admitted = sorted((t - started_at, tokens) for r in results for t, tokens in r["admitted"])
    rejected = sum(r["rejected"] for r in results)
    window_s = max(r["ended_at"] for r in results) - started_at
    tokens = sum(tokens for _, tokens in admitted)
    per_minute = tokens / window_s * 60
    per_second: list[float] = [0.0] * (int(window_s) + 1)
    for t, n in admitted:
        per_second[min(int(t), len(per_second) - 1)] += n
    return {
        "replicas": replicas,
        "precheck": precheck,
        "tpm": tpm,
        "duration_s": duration_s,
        "window_s": window_s,
        "offered_tokens_per_min": overload * tpm,
        "admitted_requests": len(admitted),
        "rejected_requests": rejected,
        "admitted_tokens": tokens,
        "admitted_tokens_per_min": per_minute,
        "ratio": per_minute / tpm,
        "per_second": per_second,
    }


def main(tpm: int = 3_000_000, duration_s: float = 30.0, overload: float = 3.0) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        try:
            return [
                run(
                    n,
                    tpm=tpm,
                    duration_s=duration_s,
                    overload=overload,
                    workdir=Path(tmp),
                    server=server,
                    precheck=precheck,
                )
                for n in (1, 4)
                for precheck in (True, False)
            ]
        finally:
            server.stop()


if __name__ == "__main__":
    for row in main(duration_s=float(sys.argv[1]) if len(sys.argv) > 1 else 30.0):
        row.pop("per_second")
        print(row)

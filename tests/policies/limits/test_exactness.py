"""Exactness under concurrency: 4 processes (gateway replicas) x 30 clients share one Redis and a
tokens-per-day limit whose refill is negligible during the test. Admitted tokens never exceed the
limit by more than one request's reservation, and once every request is settled the bucket holds
exactly the reconciled usage: no reservation, lease or ticket leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from policies.policy import hash_key
from tests.support.procs import REPO

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

TPD = 200_000
REPLICAS = 4
CLIENTS = 30
REQUESTS = 25


def test_four_replicas_never_overshoot_and_leak_nothing(tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    doc = {
        "tenants": {"t": {}},
        "keys": [{"id": "k", "tenant": "t", "sha256": hash_key("sk-exactness")}],
        "models": {"big": {}},
        "limits": [{"scope": "key", "tpd": TPD, "max_concurrent": 10_000}],
    }
    policy_path = tmp_path / "policies.yaml"
    policy_path.write_text(yaml.safe_dump(doc))
    # blocking pops below wait up to 60 s: longer than redis-py 8's default 5 s socket timeout
    control = redis.Redis.from_url(redis_url, socket_timeout=120)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.policies.limits.exactness_worker",
                "--redis",
                redis_url,
                "--prefix",
                redis_prefix,
                "--policy",
                str(policy_path),
                "--clients",
                str(CLIENTS),
                "--requests",
                str(REQUESTS),
                "--seed",
                str(i + 1),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(REPLICAS)
    ]
    for _ in procs:  # every replica connected: start them together
        assert control.blpop([f"{redis_prefix}:ready"], timeout=60) is not None
    started_s = float(control.time()[0])
    control.lpush(f"{redis_prefix}:go", *[1] * REPLICAS)
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=100)
        assert proc.returncode == 0, stderr.decode()
        results.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    seconds, micros = control.time()
    elapsed_s = seconds + micros / 1e6 - started_s + 1.0
    refill = TPD / 86_400 * elapsed_s

    admitted = [pair for r in results for pair in r["admitted"]]
    rejected = [code for r in results for code in r["rejected"]]
    actual_total = sum(actual for _, actual in admitted)
    max_reservation = max(reserved for reserved, _ in admitted)
    assert rejected and set(rejected) == {"rate_limit_exceeded"}  # the limit was reached
    assert len(admitted) > 100
    assert actual_total <= TPD + refill + max_reservation

    tag = "{" + redis_prefix + "}:"
    used_raw, updated_raw = control.hmget(tag + "b:key|tpd|k", "u", "t")
    now_s = seconds + micros / 1e6
    assert used_raw is not None and updated_raw is not None
    used = max(0.0, float(used_raw) - (now_s - float(updated_raw)) * TPD / 86_400)
    assert actual_total - refill - 1 <= used <= actual_total + 1  # the reconciled usage, nothing reserved
    assert control.zcard(tag + "tickets") == 0
    assert control.zcount(tag + "c:key|max_concurrent|k", "-inf", "+inf") == 0

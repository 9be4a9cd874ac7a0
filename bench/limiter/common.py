"""Shared by the limiter benchmarks: a private Redis server and the policies they run under."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from policies.policy import hash_key
from tests.support.procs import free_port, redis_argv

REPO = Path(__file__).resolve().parents[2]

KEY = "sk-bench-limiter"
RESULTS = REPO / "bench" / "results"


class RedisServer:
    """redis-server on a free port, no persistence; `unix=True` adds a unix socket."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is required (apt-get install redis-server)")
        self.port = free_port()
        self.socket = workdir / f"redis-{self.port}.sock"
        self.proc = subprocess.Popen(
            [*redis_argv(binary, self.port, workdir), "--unixsocket", str(self.socket), "--unixsocketperm", "700"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.RedisError:
                time.sleep(0.02)
        self.version = client.info("server")["redis_version"]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def policy_doc(limits: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "tenants": {"bench": {}},
        "keys": [{"id": "bench", "tenant": "bench", "sha256": hash_key(KEY)}],
        "models": {"m": {"default_max_tokens": 256, "price": {"input_per_mtok": 0.1, "output_per_mtok": 0.2}}},
        "limits": limits,
        **extra,
    }


BUCKETS_3 = [{"scope": "key", "rpm": 10**9, "tpm": 10**12}, {"scope": "tenant", "tpm": 10**12}]
BUCKETS_6 = [
    {"scope": "key", "rpm": 10**9, "tpm": 10**12, "tpd": 10**13},
    {"scope": "tenant", "tpm": 10**12},
    {"scope": "model", "tpm": 10**12},
    {"scope": "global", "rpm": 10**9},
]

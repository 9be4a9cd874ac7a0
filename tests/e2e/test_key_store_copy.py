"""`state: redis` keeps the keys made through the admin API in Redis, with each replica's SQLite file as
their durable copy. A copy that cannot be read at start-up (bench/chaos/disk_fuzz.py's damage) does
not stop a replica while Redis holds the store: the file is set aside and written again from Redis,
and the key made before authenticates. With Redis emptied too, nothing holds the keys: start-up
stops with the copy's one line (policies/keys/store.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.support.polling import wait_for
from tests.support.procs import start_gateway

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

POOLS = [{"name": "p", "model": "m", "engine": "vllm", "endpoints": [{"url": "http://127.0.0.1:9"}]}]


def _sections(redis_url: str, prefix: str) -> dict[str, Any]:
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix, "keys_db": "var/keys.sqlite3"}
    return {"state": state, "predictor": {"enabled": False}, "wait_ready": False}


def _ready(url: str) -> None:
    def up() -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout_s=60, what="the gateway answering")


def test_a_damaged_copy_is_rebuilt_from_redis_and_refused_only_without_it(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    workdir = tmp_path / "gw"
    sections = _sections(redis_url, redis_prefix)
    gateway = start_gateway(workdir, pools=POOLS, **sections)
    try:
        _ready(gateway.url)
        made = httpx.post(gateway.url + "/admin/keys", json={"tenant": "t1", "id": "kept"}, timeout=10)
        assert made.status_code == 201, made.text
        secret = made.json()["secret"]
    finally:
        assert gateway.stop() == 0
    copy = workdir / "var" / "keys.sqlite3"
    copy.write_bytes(b"not a database" * 300)

    gateway = start_gateway(workdir, pools=POOLS, **sections)
    try:
        _ready(gateway.url)
        reply = httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
        assert reply.status_code == 200, reply.text
        assert (workdir / "var" / "keys.sqlite3.corrupt-1").read_bytes().startswith(b"not a database")
    finally:
        assert gateway.stop() == 0
    assert "written again from Redis" in gateway.log()

    client = redis.Redis.from_url(redis_url)
    try:
        found = list(client.scan_iter(match=f"*{redis_prefix}*"))
        if found:
            client.delete(*found)
    finally:
        client.close()
    copy.write_bytes(b"not a database" * 300)
    with pytest.raises(RuntimeError, match="exited with 2"):
        start_gateway(workdir, pools=POOLS, **sections)
    log = (workdir / "gateway.log").read_text()
    said = [line for line in log.splitlines() if "cannot be read" in line]
    assert len(said) == 1 and "keys.sqlite3" in said[0] and "Traceback" not in log
    assert copy.read_bytes().startswith(b"not a database")  # left as it was

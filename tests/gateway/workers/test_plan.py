"""What each worker of a group serves (gateway/workers/plan.py): shared state, the group's engines as
static endpoints under the same ids on every worker, one-per-process files and names kept apart."""

from __future__ import annotations

import pytest

from backends.config import PoolConfig
from backends.fleet import Fleet
from backends.types import Endpoint, Role
from gateway.app.settings import GatewaySettings
from gateway.workers.plan import group_problem, static_pools, worker_count, worker_settings

LAUNCHED = {"name": "llama", "model": "llama-3.1-8b", "engine": "sim", "replicas": 2, "max_model_len": 8192}
STATIC = {"name": "remote", "model": "m", "engine": "vllm", "endpoints": [{"url": "http://10.0.0.1:8000"}]}


def _launched(pool: str, n: int) -> list[Endpoint]:
    return [
        Endpoint(id=f"{pool}/both-{i}", pool=pool, base_url=f"http://127.0.0.1:{9000 + i}", engine="sim",
                 served_model="llama-3.1-8b", role=Role.BOTH, launched=True)
        for i in range(n)
    ]  # fmt: skip


def test_launched_replicas_become_the_same_static_endpoints_on_every_worker() -> None:
    pools = [PoolConfig.model_validate(LAUNCHED), PoolConfig.model_validate(STATIC)]
    seen = static_pools(pools, _launched("llama", 2))
    assert seen[1] == pools[1]
    llama = seen[0]
    assert llama.launched_replicas == 0 and llama.served_model_name == "llama-3.1-8b"
    assert [e.url for e in llama.endpoints] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    ids = [e.id for e in Fleet.from_configs(seen).endpoints()]
    assert ids == [e.id for e in Fleet.from_configs(static_pools(pools, _launched("llama", 2))).endpoints()]


def test_memory_state_moves_to_the_private_redis_and_per_process_things_stay_apart() -> None:
    group = GatewaySettings.model_validate(
        {"pools": [STATIC], "state": {"backend": "memory", "keys_db": "var/k.sqlite3", "replicas": {"id": "gw"}}}
    )
    first, second = (
        worker_settings(group, i, port=8123, pools=list(group.pools), private_redis_url="unix:///t/r.sock")
        for i in range(2)
    )
    for worker in (first, second):
        assert worker.state.backend == "redis" and worker.state.redis_url == "unix:///t/r.sock"
        assert worker.state.shares_routing
        assert worker.server.port == 8123 and worker.server.workers == 1
    assert first.state.keys_db == second.state.keys_db == "var/k.sqlite3"  # each writes what it changes
    assert {first.state.replicas.id, second.state.replicas.id} == {"gw-w0", "gw-w1"}
    assert {first.ledger.file_prefix, second.ledger.file_prefix} == {"usage.w0", "usage.w1"}
    # their ledger files share a directory: no copy of every record in the private Redis
    assert first.ledger.stream(first.state) is None
    revalidated = GatewaySettings.model_validate(first.model_dump())  # as the worker process reads it
    assert revalidated.ledger.stream(revalidated.state) is None


def test_a_configured_redis_is_kept() -> None:
    group = GatewaySettings.model_validate(
        {"pools": [STATIC], "state": {"backend": "redis", "redis_url": "redis://10.0.0.2:6379/0"}}
    )
    worker = worker_settings(group, 1, port=1, pools=list(group.pools), private_redis_url=None)
    assert worker.state.redis_url == "redis://10.0.0.2:6379/0" and worker.state.replicas.id is None
    stream = worker.ledger.stream(worker.state)  # the cluster's records meet on the state's Redis
    assert stream is not None and stream.url == "redis://10.0.0.2:6379/0" and stream.stream == "tokenway:usage"


def test_autoscaled_pools_are_refused_and_auto_counts_cores() -> None:
    elastic = {**LAUNCHED, "replicas": 1, "autoscale": {"min_replicas": 0, "max_replicas": 2}}
    problem = group_problem(GatewaySettings.model_validate({"pools": [elastic]}))
    assert problem is not None and "llama" in problem
    assert group_problem(GatewaySettings.model_validate({"pools": [STATIC]})) is None
    assert worker_count("auto") >= 1 and worker_count(3) == 3


@pytest.mark.parametrize("value", [0, -1])
def test_workers_must_be_positive(value: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        GatewaySettings.model_validate({"server": {"workers": value}})


def test_the_serve_flag_takes_a_count_or_auto() -> None:
    from gateway.app.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--workers", "auto"]).workers == "auto"
    assert parser.parse_args(["serve", "--workers", "4"]).workers == 4
    assert parser.parse_args(["serve"]).workers is None  # server.workers decides
    for bad in ("0", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--workers", bad])

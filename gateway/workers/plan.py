"""What each worker of a group runs: its own gateway.yaml, derived from the group's.

A worker is an ordinary `tokenway serve` with three differences, all expressed as settings so that the
app factory needs no notion of workers:

- its state is shared: the configured Redis (`state: redis`), or the group's private Redis when the
  file says `state: memory`; sharing routing state through it is what makes N workers route as one;
- the engines the group launched are static endpoints to it: one supervisor (the group's parent)
  owns the processes, every worker fronts them under the same endpoint ids, so the routing state
  they share names the same engines;
- what must stay one per process is made so: the ledger file prefix and the replica name carry the
  worker's index. The durable copy of API-made keys (`state.keys_db`) is the one file every worker
  keeps: the worker that makes a change writes it there before it answers, as a replica does with
  its own copy (one writer per file would lose a change made on another worker when the group stops
  before that one has applied it); SQLite's transactions (WAL, `BEGIN IMMEDIATE`) serialise them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from backends.config import PoolConfig
from backends.types import Endpoint
from gateway.app.settings import GatewaySettings, StateSettings


def worker_count(value: int | str) -> int:
    """`server.workers` as a number: `auto` is the cores this process may run on."""
    if value == "auto":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - macOS has no affinity mask
            return max(1, os.cpu_count() or 1)
    return int(value)


def group_problem(settings: GatewaySettings) -> str | None:
    """What a group of workers cannot serve (checked before anything starts), or None."""
    elastic = [pool.name for pool in settings.pools if pool.elastic]
    if elastic:
        return (
            f"server.workers > 1 does not run autoscaled pools yet ({', '.join(elastic)}): the autoscaler "
            "sizes replicas from one process's view of demand; use workers: 1, or gateway replicas behind "
            "a balancer with state: redis (docs/scale-out.md)"
        )
    return None


def static_pools(pools: Sequence[PoolConfig], launched: Iterable[Endpoint]) -> list[PoolConfig]:
    """The pools as a worker sees them: every replica the group launched becomes one of the pool's
    static endpoints (after those the file lists), with the name the engine expects in bodies."""
    by_pool: dict[str, list[Endpoint]] = {}
    for endpoint in launched:
        by_pool.setdefault(endpoint.pool, []).append(endpoint)
    out: list[PoolConfig] = []
    for pool in pools:
        mine = by_pool.get(pool.name)
        if not mine:
            out.append(pool)
            continue
        doc: dict[str, Any] = pool.model_dump(mode="json")
        doc["replicas"], doc["roles"] = 0, None
        doc["served_model_name"] = mine[0].served_model
        doc["endpoints"] = [
            *doc["endpoints"],
            *(
                {
                    "url": e.base_url,
                    "role": e.role.value,
                    "kv_events_endpoint": e.kv_events_endpoint,
                    "kv_events_replay_endpoint": e.kv_events_replay_endpoint,
                }
                for e in mine
            ),
        ]
        out.append(PoolConfig.model_validate(doc))
    return out


def worker_settings(
    group: GatewaySettings, index: int, *, port: int, pools: list[PoolConfig], private_redis_url: str | None
) -> GatewaySettings:
    """Worker `index`'s settings (`private_redis_url`: the group's own Redis when the file says memory)."""
    state = group.state
    if private_redis_url is not None:
        state = StateSettings(
            backend="redis",
            redis_url=private_redis_url,
            key_prefix=state.key_prefix,
            redis_timeout_s=state.redis_timeout_s,
            replicas=state.replicas,
            keys_db=state.keys_db,
        )
    replicas = state.replicas
    if replicas.id is not None:  # one name per process: a reader skips entries under its own name
        replicas = replicas.model_copy(update={"id": f"{replicas.id}-w{index}"})
    state = state.model_copy(update={"replicas": replicas})
    ledger = group.ledger.model_copy(update={"file_prefix": f"{group.ledger.file_prefix}.w{index}"})
    if private_redis_url is not None:  # the workers' files share one directory already: no copy in the private Redis
        ledger = ledger.model_copy(update={"shared_stream": False})
    server = group.server.model_copy(update={"port": port, "workers": 1})
    return group.model_copy(update={"server": server, "state": state, "ledger": ledger, "pools": pools})

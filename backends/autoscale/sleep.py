"""Which engines can sleep, and how: vLLM's sleep mode (vLLM's docs/features/sleep_mode.md).

`vllm serve --enable-sleep-mode` with `VLLM_SERVER_DEV_MODE=1` registers `POST /sleep?level=N`,
`POST /wake_up` and `GET /is_sleeping` (development routes: bind such an engine to loopback or a
private network). vllm-ascend and the simulated engine serve the same routes; TensorRT-LLM has no
sleep mode, so its pools scale down by stopping.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from backends.adapters.base import LaunchSpec
from backends.config import PoolConfig

SLEEP_ENGINES: Final = frozenset({"vllm", "vllm-ascend", "sim"})
SLEEP_FLAG: Final = "--enable-sleep-mode"
DEV_MODE_ENV: Final = "VLLM_SERVER_DEV_MODE"
WAKE_PATH: Final = "/wake_up"
IS_SLEEPING_PATH: Final = "/is_sleeping"


def sleeps(pool: PoolConfig) -> bool:
    """Whether the pool scales down (or takes turns on shared devices) by sleeping."""
    return pool.autoscale is not None and pool.autoscale.sleep is not None and pool.engine in SLEEP_ENGINES


def sleep_level(pool: PoolConfig) -> int:
    return pool.autoscale.sleep.level if pool.autoscale is not None and pool.autoscale.sleep is not None else 1


def sleep_path(level: int) -> str:
    return f"/sleep?level={level}"


def with_sleep_mode(spec: LaunchSpec, pool: PoolConfig) -> LaunchSpec:
    """`spec` with sleep mode switched on when the pool sleeps (unchanged otherwise)."""
    if not sleeps(pool) or SLEEP_FLAG in spec.argv:
        return spec
    return replace(spec, argv=(*spec.argv, SLEEP_FLAG), env={**spec.env, DEV_MODE_ENV: "1"})


def sleep_problem(pool: PoolConfig) -> str | None:
    """Why the pool's `sleep:` cannot work (None when it can)."""
    if pool.autoscale is None or pool.autoscale.sleep is None or pool.engine in SLEEP_ENGINES:
        return None
    return f"engine `{pool.engine}` has no sleep mode: drop `autoscale.sleep` (its replicas stop instead)"

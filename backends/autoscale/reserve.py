"""The warm reserve of a pool that sleeps: how many replicas to keep asleep beyond the awake ones.

A step in load (a 5x burst that ramps in seconds) outruns any trend forecast, and a cold start (the
weights loaded, the engine initialised) takes longer than the step. A replica asleep at vLLM's sleep
level 1 (weights offloaded to host memory, KV cache freed) wakes by copying its weights back over PCIe:
about a second. `autoscale.warm_reserve: K` in a pool with `sleep` keeps K replicas asleep beyond the
awake ones, so the first replicas a step needs come from a wake. Per role, each pass:

    room    = max_replicas - max(desired, active)         slots the reserve may take
    target  = min(K, room)
    sleeping > target: stop the surplus (the pool gives those devices back)
    sleeping < target: start one (a spare device slot in its group) and put it to sleep once ready

and a replica drained for a scale-down sleeps while fewer than `target` others sleep, else it stops.
Without `warm_reserve` (None) every replica scaled down sleeps and stays asleep, and none is started
ahead. A sleeping replica keeps its process and its devices' CUDA context; docs/autoscaling.md says
how the benchmark counts its device.
"""

from __future__ import annotations


def reserve_target(reserve: int | None, high: int, desired: int, active: int) -> int | None:
    """Sleeping replicas one role keeps (None: no bound)."""
    if reserve is None:
        return None
    return max(min(reserve, high - max(desired, active)), 0)


def reserve_step(sleeping: int, target: int | None, spare_slots: int) -> int:
    """Replicas to start and put to sleep (> 0, one per pass), or sleeping ones to stop (< 0)."""
    if target is None:
        return 0
    if sleeping > target:
        return target - sleeping
    if sleeping < target and spare_slots > 0:
        return 1
    return 0


def keeps_asleep(others_sleeping: int, target: int | None) -> bool:
    """Whether a replica drained for a scale-down goes to sleep (else it stops)."""
    return target is None or others_sleeping < target

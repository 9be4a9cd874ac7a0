"""The planning loop's adapter demand: the loader's count of on-demand LoRA loads per pool becomes
loads per minute per ready replica over each window, and a pool past `adapter_loads_per_min` plans one
more replica (the decision itself: tests/policies/autoscale/test_adapters.py)."""

from __future__ import annotations

from pathlib import Path

from backends.types import Endpoint, EndpointState
from tests.gateway.test_autoscale_loop import Clock, autoscaler


def test_loads_per_minute_per_replica_reach_the_planner(tmp_path: Path) -> None:
    clock = Clock()
    scaler = autoscaler(tmp_path, clock, min_replicas=1, adapter_loads_per_min=30)
    pool = scaler.pools[0]
    for n in range(2):  # two replicas serving
        url = f"http://127.0.0.1:{9000 + n}"
        pool.endpoints.append(
            Endpoint(f"chat/both-{n}", "chat", url, "sim", "llama-3.1-8b", state=EndpointState.READY, launched=True)
        )
    loads = {"chat": 0}
    scaler.adapter_loads = lambda pool: loads.get(pool, 0)
    scaler.arrived("chat", 100, 16)
    scaler.tick()  # the first pass: no window yet
    assert scaler.signals["chat"][-1].adapter_loads_per_min == 0.0
    loads["chat"] = 4  # 4 loads over 2 s on 2 replicas: 60 per minute each
    clock.now += 2.0
    scaler.arrived("chat", 100, 16)
    plan = scaler.tick()[0]
    assert scaler.signals["chat"][-1].adapter_loads_per_min == 60.0
    assert plan.roles[0].current == 2 and plan.roles[0].wanted == 3, plan.reason
    assert "adapters 60.0 loads/min/replica > 30: +1" in plan.reason
    assert scaler.status()["pools"][0]["adapter_loads_per_min"] == 60.0
    clock.now += 0.1  # a pass off the schedule keeps the last window's rate
    assert scaler.tick()[0].roles[0].wanted == 3
    assert scaler.signals["chat"][-1].adapter_loads_per_min == 60.0
    clock.now += 2.0  # a window without loads: the rate falls to 0
    scaler.tick()
    assert scaler.signals["chat"][-1].adapter_loads_per_min == 0.0

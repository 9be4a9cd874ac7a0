"""Flow control's series render with bounded labels, from a live waiting room."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from gateway.flow.queue import FlowQueue, FlowRequest
from gateway.telemetry.metrics import FlowMetrics, GatewayMetrics
from policies.flow.order import MemoryCounters, band_name


def samples(metrics: GatewayMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


async def test_depth_wait_and_share_series() -> None:
    metrics = GatewayMetrics()
    metrics.allow_label_values(tenants=["acme"], pools=["llama"])
    flow = FlowMetrics(metrics)
    queue = FlowQueue(
        MemoryCounters(), on_wait=lambda pool, band, tenant, s: flow.observe_wait(pool, band_name(band), tenant, s)
    )
    flow.set_status(queue.status)
    for tenant in ("acme", "stranger"):
        request = FlowRequest("r", tenant, 2, 100.0, 1.0, time.monotonic() + 10)
        await queue.hold("llama", request, lambda: "go")
    found = samples(metrics)
    waits = {(s[0]["tenant"], s[0]["band"]) for s in found["tokenway_queue_wait_seconds_count"]}
    assert waits == {("acme", "normal"), ("other", "normal")}  # an unconfigured tenant is `other`
    depth = {s[0]["band"]: s[1] for s in found["tokenway_queue_depth"] if s[0]["pool"] == "llama"}
    assert depth == {"critical": 0, "high": 0, "normal": 0, "low": 0, "sheddable": 0}
    shares = {s[0]["tenant"]: s[1] for s in found["tokenway_fair_share_ratio"]}
    assert shares == {"acme": 1.0, "other": 1.0}
    assert "tokenway_queue_wait_seconds" in {f.name for f in metrics.families}  # pushed over OTLP too

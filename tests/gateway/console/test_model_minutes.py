"""Per-model counters in each minute of the console's last hour: counted per model of the policy,
bounded whatever names clients send, and summed across replicas like the other counters."""

from __future__ import annotations

import yaml

from gateway.console.activity import OTHER, ConsoleActivity, overview_of, summed
from gateway.request.record import RequestRecord
from policies.loader import parse_config
from policies.policy import Policy

POLICY = Policy(parse_config(yaml.safe_dump({"models": {"big": {}, "small": {}}})))
NOW = 1_800_000_000.0


def record(i: int, **fields: object) -> RequestRecord:
    base = RequestRecord(request_id=f"r{i}", api="chat", started_at_unix_s=NOW - 30, duration_s=0.5, tenant="t")
    for name, value in fields.items():
        setattr(base, name, value)
    return base


def test_each_minute_counts_requests_errors_and_ttft_per_model() -> None:
    activity = ConsoleActivity(lambda: POLICY, clock=lambda: NOW)
    activity.observe(record(1, model="big", requested_model="big", ttft_s=0.04, stream=True))
    activity.observe(record(2, model="big", requested_model="big", ttft_s=0.3, stream=True))
    activity.observe(record(3, model="big", requested_model="big", status="error", http_status=502))
    activity.observe(record(4, requested_model="small", status="rejected", http_status=429))
    minute = activity.minutes()[-1]
    big, small = minute["models"]["big"], minute["models"]["small"]
    assert (big["requests"], big["served"], big["errors"], big["ttft_n"]) == (3, 2, 1, 2)
    assert big["duration_sum_ms"] == 1000.0 and big["ttft_sum_ms"] == 340.0
    assert big["ttft_le_ms"]["50"] == 1 and big["ttft_le_ms"]["500"] == 1 and sum(big["ttft_le_ms"].values()) == 2
    assert (small["requests"], small["errors"], small["served"]) == (1, 0, 0)  # a rejection is not an error
    found = activity.overview()
    assert found["models"] == ["big", "small"]
    assert found["summary"]["requests"] == 4  # the nested counters are not summed into the totals


def test_names_outside_the_policy_share_one_counter() -> None:
    activity = ConsoleActivity(lambda: POLICY, clock=lambda: NOW)
    for i in range(500):
        activity.observe(record(i, requested_model=f"made-up-{i}", status="error", http_status=404))
    models = activity.minutes()[-1]["models"]
    assert list(models) == [OTHER] and models[OTHER]["errors"] == 500


def test_replicas_minutes_sum_model_by_model() -> None:
    one = ConsoleActivity(lambda: POLICY, clock=lambda: NOW)
    two = ConsoleActivity(lambda: POLICY, clock=lambda: NOW)
    one.observe(record(1, model="big", ttft_s=0.04))
    two.observe(record(2, model="big", ttft_s=0.04))
    two.observe(record(3, model="small", status="error", http_status=502))
    a, b = one.minutes()[-1], two.minutes()[-1]
    merged = {k: summed(a.get(k), v) if k != "t" else v for k, v in b.items()}
    assert merged["models"]["big"]["requests"] == 2 and merged["models"]["big"]["ttft_le_ms"]["50"] == 2
    assert merged["models"]["small"]["errors"] == 1 and merged["requests"] == 3
    assert a["models"]["big"]["requests"] == 1  # the parts are left as they were
    assert overview_of([merged], NOW)["summary"]["errors"] == 1

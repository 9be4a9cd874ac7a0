"""The console's last hour and live tail: counts per minute, rates, SLO attainment, bounded memory."""

from __future__ import annotations

import yaml

from gateway.console.activity import MINUTES, ConsoleActivity
from gateway.console.sessions import ConsoleSessions
from gateway.request.record import RequestRecord
from policies.loader import parse_config
from policies.policy import Policy

POLICY = Policy(parse_config(yaml.safe_dump({"slo_classes": {"fast": {"ttft_ms": 100, "on_miss": "proceed"}}})))
NOW = 1_800_000_000.0


def record(i: int, **fields: object) -> RequestRecord:
    base = RequestRecord(request_id=f"r{i}", api="chat", started_at_unix_s=NOW - 30, duration_s=1.0, tenant="t")
    for name, value in fields.items():
        setattr(base, name, value)
    return base


def test_counts_rates_and_slo_attainment() -> None:
    activity = ConsoleActivity(lambda: POLICY, clock=lambda: NOW)
    activity.observe(record(1, prompt_tokens=100, completion_tokens=20, cost_usd=0.5, ttft_s=0.05, stream=True,
                            slo_class="fast"))  # fmt: skip
    activity.observe(record(2, ttft_s=0.5, stream=True, slo_class="fast"))  # missed its 100 ms
    activity.observe(record(3, status="rejected", http_status=429, reject_reason="rate_limited"))
    activity.observe(record(4, fallback_from="big", model="small"))
    activity.observe(record(5, status="error", http_status=502, error_code="upstream_error"))
    summary = activity.overview()["summary"]
    assert (summary["requests"], summary["served"], summary["rejected"], summary["errors"]) == (5, 3, 1, 1)
    assert summary["slo_attainment"] == 0.5 and summary["fallback_rate"] == 0.2
    assert summary["cpm_usd"] == 0.5 / 120 * 1e6
    assert len(activity.overview()["minutes"]) == MINUTES  # a full hour, empty minutes as zeros
    tail = activity.tail()
    assert [row["request_id"] for row in tail] == ["r5", "r4", "r3", "r2", "r1"]
    assert tail[1]["fallback"] == "big->small" and tail[0]["reason"] == "upstream_error"
    assert activity.tail(after=tail[1]["seq"]) == tail[:1]


def test_the_tail_and_the_minutes_are_bounded() -> None:
    activity = ConsoleActivity(lambda: POLICY, tail_size=10, clock=lambda: NOW)
    for i in range(1000):
        activity.observe(record(i, started_at_unix_s=NOW - 7200 + i * 7.2))  # two hours of minutes
    assert len(activity.tail(limit=1000)) == 10


def test_sessions_expire_and_are_bounded() -> None:
    now = [0.0]
    sessions = ConsoleSessions(ttl_s=10, clock=lambda: now[0])
    first, csrf = sessions.open()
    assert sessions.csrf_of(first) == csrf and len(csrf) >= 32
    assert sessions.valid(first) and not sessions.valid("forged") and not sessions.valid(None)
    now[0] = 11
    assert not sessions.valid(first)
    many = [sessions.open()[0] for _ in range(300)]
    assert not sessions.valid(many[0]) and sessions.valid(many[-1])
    sessions.close(many[-1])
    assert not sessions.valid(many[-1])

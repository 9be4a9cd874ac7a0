"""The SLO gate's gateway side: header parsing, running TPOT SLOs per endpoint, 503s (its waits are
flow control's: tests/gateway/flow/)."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest, Rejected
from gateway.flow.checks import (
    REASON_QUEUE_TIMEOUT,
    REASON_SHED,
    RunningTpotSlos,
    slo_miss,
)
from gateway.request.intake import parse_slo_headers
from policies.slo import EndpointCheck, Miss, Slo


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param({}, (None, None), id="absent"),
        pytest.param({"x-slo-ttft-ms": "250"}, (250.0, None), id="ttft"),
        pytest.param({"x-slo-ttft-ms": " 250.5 ", "x-slo-tpot-ms": "20"}, (250.5, 20.0), id="both"),
    ],
)
def test_parse_slo_headers(headers: dict[str, str], expected: tuple[float | None, float | None]) -> None:
    assert parse_slo_headers(headers) == expected


@pytest.mark.parametrize("value", ["abc", "", "0", "-5", "nan", "inf", "1e12", "100ms"])
@pytest.mark.parametrize("name", ["x-slo-ttft-ms", "x-slo-tpot-ms"])
def test_malformed_slo_header_is_a_400_naming_it(name: str, value: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_slo_headers({name: value})
    assert info.value.status == 400 and info.value.param == name


def test_running_tpot_slos_track_the_tightest_per_endpoint() -> None:
    running = RunningTpotSlos()
    a = running.begin("e1", 50.0)
    b = running.begin("e1", 20.0)
    c = running.begin("e1", 20.0)
    assert running.begin("e2", None) is None
    assert running.floors == {"e1": 20.0}
    running.end(b)
    assert running.floors == {"e1": 20.0}  # another 20 ms request is still there
    running.end(c)
    assert running.floors == {"e1": 50.0}
    running.end(a)
    running.end(a)  # idempotent enough: a second end changes nothing
    assert running.floors == {}


def test_slo_miss_is_a_503_with_retry_after() -> None:
    miss = Miss("shed", EndpointCheck("e1", ttft_excess_ms=2300.0, tpot_excess_ms=0.0, idle=False))
    raised = slo_miss(miss, Slo(200.0, 30.0), "llama", REASON_SHED)
    assert isinstance(raised.error, Rejected) and raised.trigger == "shed"
    rejection = raised.error.rejection
    assert (rejection.status, rejection.type, rejection.code, rejection.reason) == (
        503,
        "server_error",
        "slo_unattainable",
        "shed",
    )
    assert dict(rejection.headers) == {"retry-after": "3", "retry-after-ms": "3000"}
    assert "TTFT <= 200 ms, TPOT <= 30 ms" in rejection.message and not raised.fallback
    fallback = slo_miss(Miss("fallback", miss.closest), Slo(200.0, None), "llama", "slo_unattainable")
    assert fallback.fallback
    timeout = slo_miss(Miss("queue", miss.closest), Slo(200.0, None), "llama", REASON_QUEUE_TIMEOUT, waited_ms=812)
    assert timeout.error.message.startswith("Waited 812 ms")


def test_slo_miss_message_says_how_likely_the_closest_endpoint_was() -> None:
    likely = EndpointCheck("e1", ttft_excess_ms=-20.0, tpot_excess_ms=4.0, idle=False, probability=0.31)
    message = slo_miss(Miss("reject", likely), Slo(200.0, 30.0), "llama", "slo_unattainable").error.message
    assert "(closest endpoint: 31% likely to meet it; TPOT 4.0 ms over)" in message
    p90 = slo_miss(Miss("reject", likely), Slo(200.0, 30.0, compare="p90"), "llama", "slo_unattainable")
    assert "likely" not in p90.error.message and "TPOT 4.0 ms over" in p90.error.message

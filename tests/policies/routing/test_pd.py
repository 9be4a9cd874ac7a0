"""PD placement: decide_pd over plain candidates, and the router on a disaggregated pool."""

from __future__ import annotations

import logging

import pytest

from backends.config import PoolConfig
from backends.fleet import Pool
from backends.types import Endpoint, Role
from policies.routing.config import PDConfig
from policies.routing.pd import decide_pd
from policies.routing.pipeline import build_router, is_disaggregated
from tests.policies.routing.factories import NOW_S, candidate, context, endpoint, pool, request, token_ids


def pd_pool(eps: list[Endpoint]) -> Pool:
    return Pool(PoolConfig(name="pd", model="m", roles={"prefill": 2, "decode": 2}), endpoints=eps)


def pd_endpoints() -> list[Endpoint]:
    return [
        endpoint("prefill-0", pool="pd", role=Role.PREFILL),
        endpoint("prefill-1", pool="pd", role=Role.PREFILL),
        endpoint("decode-0", pool="pd", role=Role.DECODE),
        endpoint("decode-1", pool="pd", role=Role.DECODE),
    ]


@pytest.mark.parametrize(
    ("config", "decode_cached", "prefill_backlog", "has_prefill", "expected"),
    [
        pytest.param(PDConfig(), 0, 0, True, ("prefill-a", "disaggregated"), id="long-uncached-prompt"),
        pytest.param(PDConfig(), 3700, 0, True, (None, "few-uncached"), id="mostly-cached-on-decode"),
        pytest.param(
            PDConfig(min_uncached_tokens=0), 4000, 0, True, ("prefill-a", "disaggregated"), id="zero-threshold"
        ),
        pytest.param(PDConfig(), 0, 0, False, (None, "no-prefill-endpoint"), id="no-prefill-endpoint"),
        pytest.param(
            PDConfig(max_prefill_backlog_tokens=10_000), 0, 20_000, True, (None, "prefill-busy"), id="prefill-busy"
        ),
        pytest.param(PDConfig(enabled=False), 0, 0, True, (None, "disabled"), id="disabled"),
    ],
)
def test_decide_pd(
    config: PDConfig, decode_cached: int, prefill_backlog: int, has_prefill: bool, expected: tuple[str | None, str]
) -> None:
    decode = candidate(endpoint("decode"), decode_cached)
    prefills = [candidate(endpoint("prefill-a", prefill_tokens=prefill_backlog))] if has_prefill else []
    outcome = decide_pd(context(4000), decode, prefills, lambda options: options[0], config)
    assert (outcome.prefill.id if outcome.prefill else None, outcome.reason) == expected


@pytest.mark.parametrize(
    ("roles", "expected"),
    [
        pytest.param([Role.BOTH, Role.BOTH], False, id="ordinary"),
        pytest.param([Role.PREFILL, Role.DECODE], True, id="pd-roles"),
        pytest.param([Role.DECODE], True, id="decode-only-still-pd"),
    ],
)
def test_is_disaggregated(roles: list[Role], expected: bool) -> None:
    assert is_disaggregated(pool([endpoint(f"e{i}", role=r) for i, r in enumerate(roles)])) is expected


def test_router_disaggregates_a_long_new_prompt_and_keeps_the_follow_up_local() -> None:
    r = build_router({"seed": 3})
    eps = pd_endpoints()
    first = request(token_ids(4096))
    d = r.route(first, pd_pool(eps), NOW_S)
    assert d is not None and d.pd_reason == "disaggregated" and d.disaggregated
    assert d.endpoint.role is Role.DECODE and d.prefill_endpoint is not None and d.prefill_endpoint.role is Role.PREFILL
    assert d.uncached_prefill_tokens(4096) == 4096
    r.on_dispatch(first, d)
    follow_up = request(token_ids(4096) + token_ids(200, start=5))
    d2 = r.route(follow_up, pd_pool(eps), NOW_S)
    assert d2 is not None and d2.endpoint is d.endpoint and d2.reason == "prefix-hit"
    assert (d2.pd_reason, d2.prefill_endpoint) == ("few-uncached", None)
    assert r.report(NOW_S).pd["pd"].served == 1


def test_router_picks_the_prefill_endpoint_holding_the_prefix() -> None:
    r = build_router({"seed": 3, "pd": {"min_uncached_tokens": 256}})
    eps = pd_endpoints()
    system = token_ids(8192)
    r.index.record(request(system).prompt, eps[1], NOW_S)  # prefill-1 prefilled this system prompt before
    f = request(system + token_ids(1024, start=9), debug=True)
    d = r.route(f, pd_pool(eps), NOW_S)
    assert d is not None and d.prefill_endpoint is eps[1]
    assert d.prefill_cached_tokens_estimate == 8192 and d.uncached_prefill_tokens(f.facts.prompt_tokens) == 1024
    assert "prefill:prefill-1=[" in d.debug_header()


def test_no_ready_prefill_endpoint_prefills_on_decode() -> None:
    eps = pd_endpoints()
    d = build_router({"seed": 3}).route(
        request(token_ids(4096)), pd_pool(eps), NOW_S, exclude={"prefill-0", "prefill-1"}
    )
    assert d is not None and d.endpoint.role is Role.DECODE and d.pd_reason == "no-prefill-endpoint"


def test_warns_when_a_pd_pool_never_disaggregates(caplog: pytest.LogCaptureFixture) -> None:
    r = build_router({"seed": 3, "pd": {"min_uncached_tokens": 100_000, "warn_after_requests": 5}})
    eps = pd_endpoints()
    with caplog.at_level(logging.WARNING, logger="policies.routing.pipeline"):
        for i in range(7):
            f = request(token_ids(2048, start=i + 1))
            d = r.route(f, pd_pool(eps), NOW_S)
            assert d is not None
            r.on_dispatch(f, d)
    warnings = [rec for rec in caplog.records if "disaggregated none" in rec.message]
    assert len(warnings) == 1
    counters = r.report(NOW_S).pd["pd"]
    assert (counters.served, counters.disaggregated, counters.warned) == (7, 0, True)


@pytest.mark.parametrize(
    ("backlog", "decode_kv", "decode_pending", "expected"),
    [
        pytest.param(4_000, 0.2, 0, "disaggregated", id="prefill-keeps-up"),
        pytest.param(20_000, 0.2, 0, "prefill-backlog", id="backlog-and-headroom"),
        pytest.param(20_000, 0.95, 0, "disaggregated", id="decode-kv-full"),
        pytest.param(20_000, 0.2, 9_000, "disaggregated", id="decode-already-prefilling"),
    ],
)
def test_convertible_decoders_prefill_during_a_backlog(
    backlog: int, decode_kv: float, decode_pending: int, expected: str
) -> None:
    from policies.routing.config import ConvertibleConfig

    config = PDConfig(convertible=ConvertibleConfig(backlog_tokens=8192))
    decode_endpoint = endpoint("decode", prefill_tokens=decode_pending)
    decode_endpoint.stats.kv_usage_ratio = decode_kv
    prefills = [candidate(endpoint("prefill-a", prefill_tokens=backlog))]
    outcome = decide_pd(context(4000), candidate(decode_endpoint, 0), prefills, lambda options: options[0], config)
    assert outcome.reason == expected

"""Token-aware admission through real gateway processes, simulated engines and the official openai
client: fallback to the cheaper model with its header, 429s the client retries at the right time,
budgets, hot reload, four gateways sharing one Redis exactly, and Redis killed mid-run.

Every test skips (saying so) while the gateway still runs without policies' Admission: the check is
one request under a limit that must carry x-ratelimit-* headers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis
import yaml

from policies.estimate import PromptEstimator
from policies.policy import hash_key
from tests.policies.limits.redis_proc import RedisProcess
from tests.support.polling import wait_for
from tests.support.procs import (
    OTHER_KEY,
    TEST_KEY,
    Gateway,
    SimEngines,
    http_get,
    running,
    start_gateway,
    start_sim,
    static_pool,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LLAMA, QWEN = "llama-3.1-8b", "qwen2.5-7b"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def doc(limits: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    """Tenants open (fallback allowed, TEST_KEY) and strict (no fallback, OTHER_KEY); llama falls back
    to the cheaper qwen when rate limited or over budget."""
    return {
        "tenants": {"open": {}, "strict": {"allow_fallback": False}},
        "keys": [
            {"id": "k-open", "tenant": "open", "sha256": hash_key(TEST_KEY)},
            {"id": "k-strict", "tenant": "strict", "sha256": hash_key(OTHER_KEY)},
        ],
        "models": {
            LLAMA: {
                "aliases": ["gpt-4o-mini"],
                "context_length": 16384,
                "default_max_tokens": 64,
                "price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0},
                "fallbacks": [{"model": QWEN, "triggers": ["rate_limited", "budget_exhausted"]}],
            },
            QWEN: {
                "context_length": 16384,
                "default_max_tokens": 64,
                "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
            },
        },
        "limits": limits or [],
        **extra,
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimEngines, SimEngines]]:
    workdir = tmp_path_factory.mktemp("admission-engines")
    llama = start_sim(workdir, count=1, served_model_name=LLAMA, time_scale=50.0)
    qwen = start_sim(workdir, count=1, served_model_name=QWEN, preset="qwen2.5-7b@h100", time_scale=50.0)
    with running(llama, qwen):
        yield llama, qwen


def gateway(
    workdir: Path, engines: tuple[SimEngines, SimEngines], policies: dict[str, Any], **sections: Any
) -> Gateway:
    llama, qwen = engines
    pools = [static_pool("llama", LLAMA, llama.urls), static_pool("qwen", QWEN, qwen.urls)]
    return start_gateway(workdir, pools=pools, policies=policies, **sections)


def client(gw: Gateway, key: str = TEST_KEY, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=max_retries, timeout=30)


def chat(gw: Gateway, key: str = TEST_KEY, model: str = LLAMA, max_retries: int = 0, **extra: Any) -> Any:
    return client(gw, key, max_retries).chat.completions.with_raw_response.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=extra.pop("max_tokens", 8),
        **extra,
    )


def require_admission(response: Any) -> None:
    """A response under a configured limit carries the tightest bucket's x-ratelimit-* headers."""
    headers = response.headers
    assert headers.get("x-ratelimit-limit-requests") is not None or headers.get("x-ratelimit-limit-tokens") is not None


def test_over_limit_on_the_expensive_model_is_served_by_the_cheaper_one(
    tmp_path: Path, engines: tuple[SimEngines, SimEngines]
) -> None:
    limits = [
        {"scope": "key_model", "match": {"model": LLAMA}, "rpm": 1},
        {"scope": "key_model", "match": {"model": QWEN}, "rpm": 100},
    ]
    gw = gateway(tmp_path / "gw", engines, doc(limits))
    with running(gw):
        first = chat(gw)
        require_admission(first)
        assert first.parse().model == LLAMA and first.headers.get("x-tokenway-fallback") is None
        second = chat(gw, model="gpt-4o-mini")
        assert second.parse().model == QWEN  # the model that served it
        assert second.headers["x-tokenway-fallback"] == f"{LLAMA}->{QWEN};reason=rate_limited"
        assert second.headers["x-ratelimit-limit-requests"] == "100"  # re-admitted at qwen's limits
        stream = client(gw).chat.completions.with_raw_response.create(
            model=LLAMA,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            stream=True,
        )
        assert stream.headers["x-ratelimit-limit-requests"] == "100"  # streamed responses carry them too
        assert "x-ratelimit-remaining-requests" in stream.headers
        assert list(stream.parse())  # the whole stream arrives
        # fallback disabled for the tenant: the 429 itself, exactly as the catalogue says
        chat(gw, key=OTHER_KEY)
        with pytest.raises(openai.RateLimitError) as info:
            chat(gw, key=OTHER_KEY)
        error = info.value
        assert error.code == "rate_limit_exceeded" and error.type == "requests"
        assert "Limit 1, Used 1, Requested 1" in error.message
        assert float(error.response.headers["retry-after-ms"]) > 0
        assert error.response.headers["retry-after"] == "60"
        # per-request opt-out behaves like a tenant without fallback
        with pytest.raises(openai.RateLimitError):
            chat(gw, extra_headers={"x-tokenway-no-fallback": "1"})


def test_the_openai_client_honours_retry_after_ms(tmp_path: Path, engines: tuple[SimEngines, SimEngines]) -> None:
    prompt_tokens, _ = asyncio.run(PromptEstimator().chat(MESSAGES))
    # count input only (exact), capacity a hair under two requests: the second waits ~0.5 s of refill
    tpm = (240 * prompt_tokens) // 121
    gw = gateway(tmp_path / "gw", engines, doc([{"scope": "key", "tpm": tpm, "count": "input"}]))
    with running(gw):
        require_admission(chat(gw, key=OTHER_KEY))
        retried = chat(gw, key=OTHER_KEY, max_retries=2)
        assert retried.retries_taken == 1  # one 429, then the wait it announced was enough
        assert retried.parse().choices[0].message.content


def test_a_request_that_would_cross_the_budget(tmp_path: Path, engines: tuple[SimEngines, SimEngines]) -> None:
    # llama reserves up to ~$0.02 a request here (64 output tokens at $300/M): a $0.05 budget per key
    # holds two or three; qwen costs a hundredth of that
    budgets = [{"scope": "key", "usd_per_day": 0.05}]
    gw = gateway(tmp_path / "gw", engines, doc([{"scope": "key", "rpm": 1000}], budgets=budgets))
    with running(gw):
        require_admission(chat(gw, key=OTHER_KEY, max_tokens=64))
        with pytest.raises(openai.RateLimitError) as info:  # strict tenant: no fallback
            for _ in range(10):
                chat(gw, key=OTHER_KEY, max_tokens=64, max_retries=2)
        assert info.value.code == "insufficient_quota" and info.value.type == "insufficient_quota"
        assert info.value.response.headers["x-should-retry"] == "false"
        reasons = []
        for _ in range(10):  # open tenant: the request that would cross the budget runs on qwen
            response = chat(gw, key=TEST_KEY, max_tokens=64)
            reasons.append(response.headers.get("x-tokenway-fallback"))
            if reasons[-1] is not None:
                assert response.parse().model == QWEN
                break
        assert reasons[-1] == f"{LLAMA}->{QWEN};reason=budget_exhausted"


def test_hot_reload_applies_without_restart_and_keeps_the_policy_on_errors(
    tmp_path: Path, engines: tuple[SimEngines, SimEngines]
) -> None:
    gw = gateway(tmp_path / "gw", engines, doc([{"scope": "key", "rpm": 1}]))
    path = gw.workdir / "policies.yaml"
    with running(gw):
        require_admission(chat(gw, key=OTHER_KEY))
        with pytest.raises(openai.RateLimitError):
            chat(gw, key=OTHER_KEY)
        path.write_text(yaml.safe_dump(doc([{"scope": "key", "rpm": 1000}])))
        wait_for(lambda: _ok(gw), timeout_s=15, interval_s=0.2, what="the new limit to apply")
        path.write_text("limits:\n  - scope: key\n    rpm: lots\n")
        wait_for(lambda: _rejected_reload(gw), timeout_s=15, interval_s=0.2, what="the bad file to be rejected")
        for _ in range(5):
            assert _ok(gw)  # still the rpm 1000 policy
        status, _ = http_get(gw.url + "/admin/status")
        assert status == 200 and gw.proc.poll() is None


def _rejected_reload(gw: Gateway) -> bool:
    """The watcher has read the bad file and kept the running policy (its error is on record)."""
    status, text = http_get(gw.url + "/admin/status")
    return status == 200 and bool(json.loads(text)["policy"]["last_error"])


def _ok(gw: Gateway) -> bool:
    try:
        chat(gw, key=OTHER_KEY)
    except openai.RateLimitError:
        return False
    return True


def test_four_gateways_sharing_redis_admit_exactly(
    tmp_path: Path, engines: tuple[SimEngines, SimEngines], own_redis: RedisProcess
) -> None:
    """Exactness of the shared buckets, not Redis failure handling (`test_redis_killed_mid_run`): the
    gateways get a Redis timeout a loaded test machine meets, and fail closed, so a slow answer can
    only refuse a request, never admit one from the local fallback buckets."""
    tpd = 20_000
    admission = {"replicas": 4, "store_failure": "fail_closed"}
    policies = doc([{"scope": "key", "tpd": tpd, "max_concurrent": 1000}], admission=admission)
    state = {"backend": "redis", "redis_url": own_redis.url, "redis_timeout_s": 10.0}
    with ThreadPoolExecutor(4) as pool:
        gateways = list(pool.map(lambda i: gateway(tmp_path / f"gw{i}", engines, policies, state=state), range(4)))
    with running(*gateways):
        started_s = time.monotonic()  # the bucket refills from its first charge on
        probe = chat(gateways[0], key=OTHER_KEY, max_tokens=1)
        require_admission(probe)
        results = asyncio.run(_hammer([g.base_url for g in gateways], clients=120, requests=6))
        stores = [_store_status(g) for g in gateways]  # in the message of a failure below
    served = [r for r in results if r[0] == 200]
    limited = [r for r in results if r[0] == 429]
    assert served and limited and len(served) + len(limited) == len(results), ({r[0] for r in results}, stores)
    client_r = own_redis.client()
    keys = [k.decode() for k in client_r.scan_iter(match="*:b:*tpd*")]
    assert len(keys) == 1
    used_raw = client_r.hget(keys[0], "u")
    refill = tpd / 86_400 * (time.monotonic() - started_s)  # what the bucket regained meanwhile
    assert used_raw is not None
    used_total = sum(r[1] for r in served) + probe.parse().usage.total_tokens
    reservation = max(r[2] for r in served)
    assert used_total <= tpd + refill + reservation, stores  # never beyond the limit by more than one reservation
    assert used_total - refill <= float(used_raw) <= used_total + 1  # the reconciled usage, no reservation left
    tickets = [k for k in client_r.scan_iter(match="*:tickets")]
    assert all(client_r.zcard(k) == 0 for k in tickets)


def _store_status(gw: Gateway) -> dict[str, Any]:
    """The limiter store's counters (Redis errors, breaker trips, local fail-open admissions)."""
    status, text = http_get(gw.url + "/admin/status", timeout_s=10)
    admission = json.loads(text).get("admission", {}) if status == 200 else {}
    keep = ("redis_errors", "breaker_trips", "local_admissions", "voided", "voided_undone", "replayed")
    return {name: admission.get(name) for name in keep}


async def _hammer(base_urls: list[str], clients: int, requests: int) -> list[tuple[int, int, int]]:
    """(status, usage total, reservation) of every request; `clients` concurrent, round-robin over gateways."""
    out: list[tuple[int, int, int]] = []
    body = {"model": LLAMA, "messages": MESSAGES, "max_tokens": 16}
    headers = {"Authorization": f"Bearer {OTHER_KEY}"}
    prompt_tokens, _ = await PromptEstimator().chat(MESSAGES)

    async def one_client(i: int, session: aiohttp.ClientSession) -> None:
        for j in range(requests):
            url = base_urls[(i + j) % len(base_urls)] + "/chat/completions"
            async with session.post(url, json=body, headers=headers) as response:
                data = json.loads(await response.read())
                usage = data.get("usage") or {}
                out.append((response.status, int(usage.get("total_tokens", 0)), prompt_tokens + 16))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(one_client(i, session) for i in range(clients)))
    return out


@pytest.mark.parametrize("store_failure", ["fail_open", "fail_closed"])
def test_redis_killed_mid_run(
    tmp_path: Path, engines: tuple[SimEngines, SimEngines], own_redis: RedisProcess, store_failure: str
) -> None:
    admission = {"store_failure": store_failure, "replicas": 2, "breaker": {"failure_threshold": 1, "open_s": 1}}
    policies = doc([{"scope": "key", "rpm": 10}], admission=admission)
    gw = gateway(tmp_path / "gw", engines, policies, state={"backend": "redis", "redis_url": own_redis.url})
    with running(gw):
        require_admission(chat(gw, key=OTHER_KEY))
        own_redis.kill()
        if store_failure == "fail_open":
            served = 0
            with pytest.raises(openai.RateLimitError):
                for _ in range(10):
                    chat(gw, key=OTHER_KEY)
                    served += 1
            assert 1 <= served <= 5  # this replica's share: 10 rpm / 2 replicas, less what was used
        else:
            with pytest.raises(openai.InternalServerError) as info:
                chat(gw, key=OTHER_KEY)
            assert info.value.status_code == 503 and info.value.code == "limiter_unavailable"
            assert "retry-after" in info.value.response.headers
        own_redis.start()
        wait_for(
            lambda: _served_from_redis(gw, own_redis), timeout_s=15, interval_s=0.2, what="shared limiting to resume"
        )


def _served_from_redis(gw: Gateway, server: RedisProcess) -> bool:
    try:
        chat(gw, key=TEST_KEY)
    except (openai.RateLimitError, openai.InternalServerError):
        return False
    try:
        return any(True for _ in server.client().scan_iter(match="*:b:*"))
    except redis.RedisError:
        return False

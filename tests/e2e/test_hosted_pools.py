"""Hosted providers as pools, end to end: a real `tokenway serve` in front of provider stand-ins
(`python -m sim.hosted`, which reject what the real APIs reject, Bedrock's SigV4 included), the
official clients in front of the gateway."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.ledger.reader import iter_entries
from tests.sim.hosted.standin import StandIn, standin
from tests.support.procs import TEST_KEY, Gateway, free_port, policies_doc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SONNET, HAIKU = "claude-sonnet-4-5", "claude-haiku-4-5"
HI: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's environment: the stand-ins' key under the names the pools give, AWS's chain for Bedrock."""
    monkeypatch.setenv("TW_ANTHROPIC_KEY", "test-key")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-key")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def anthropic_standin() -> Iterator[StandIn]:
    with standin("anthropic") as running:
        yield running


@pytest.fixture
def bedrock_standin() -> Iterator[StandIn]:
    with standin("bedrock") as running:
        yield running


def anthropic_pool(url: str, model: str = SONNET, **extra: Any) -> dict[str, Any]:
    return {
        "name": "claude",
        "model": model,
        "engine": "anthropic",
        "served_model_name": "claude-sonnet-4-5-20250929",
        "api_key_env": "TW_ANTHROPIC_KEY",
        "endpoints": [{"url": url}],
        **extra,
    }


def bedrock_pool(url: str, model: str = HAIKU) -> dict[str, Any]:
    return {
        "name": "bedrock",
        "model": model,
        "engine": "bedrock",
        "region": "us-east-1",
        "served_model_name": "us.anthropic.claude-haiku-4-5-20251001-v1:0",
        "endpoints": [{"url": url}],
    }


def models(*names: str, **extra: dict[str, Any]) -> dict[str, Any]:
    return {name: extra.get(name, {}) for name in names}


def test_chat_reaches_anthropic_streamed_and_not(
    keys: None, anthropic_standin: StandIn, gateway_factory: Callable[..., Gateway]
) -> None:
    gateway = gateway_factory(
        pools=[anthropic_pool(anthropic_standin.url)], policies=policies_doc(models=models(SONNET))
    )
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    answer = client.chat.completions.create(model=SONNET, messages=HI, max_tokens=16)
    assert answer.model == SONNET and answer.choices[0].message.content
    assert answer.id and answer.created > 0
    assert answer.usage is not None and answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=SONNET, messages=HI, max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and all(c.model == SONNET for c in chunks)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0
    # an untranslatable field is refused with a 400 naming it; nothing reaches the provider
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=SONNET, messages=HI, max_tokens=16, logit_bias={"1": 5})
    assert refused.value.param == "logit_bias" or "logit_bias" in refused.value.message


def test_messages_reach_bedrock_signed_and_streamed(
    keys: None, bedrock_standin: StandIn, gateway_factory: Callable[..., Gateway]
) -> None:
    gateway = gateway_factory(pools=[bedrock_pool(bedrock_standin.url)], policies=policies_doc(models=models(HAIKU)))
    client = anthropic.Anthropic(base_url=gateway.url, api_key=TEST_KEY, max_retries=0)
    message = client.messages.create(model=HAIKU, max_tokens=16, messages=HI)
    assert message.model == HAIKU and message.content and message.usage.output_tokens > 0
    with client.messages.stream(model=HAIKU, max_tokens=16, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens > 0


def test_a_provider_429_falls_back_to_the_next_model(
    keys: None, anthropic_standin: StandIn, bedrock_standin: StandIn, gateway_factory: Callable[..., Gateway]
) -> None:
    chain = {SONNET: {"fallbacks": [{"model": HAIKU, "triggers": ["upstream_error", "rate_limited"]}]}}
    gateway = gateway_factory(
        pools=[anthropic_pool(anthropic_standin.url), bedrock_pool(bedrock_standin.url)],
        policies=policies_doc(models=models(SONNET, HAIKU, **chain)),
    )
    anthropic_standin.fault(429, count=10)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    answer = client.chat.completions.with_raw_response.create(model=SONNET, messages=HI, max_tokens=16)
    assert answer.parse().model == HAIKU
    assert answer.headers["x-tokenway-fallback"].startswith(f"{SONNET}->{HAIKU}")


def ledger_records(ledger: Path, request_id: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = [r for r in iter_entries(ledger) if r["request_id"] == request_id] if ledger.exists() else []
        if found:
            time.sleep(0.3)  # a second record would be written by now
            return [r for r in iter_entries(ledger) if r["request_id"] == request_id]
        time.sleep(0.05)
    return []


PRICE = {"input_per_mtok": 3.0, "cached_input_per_mtok": 0.30, "cache_write_per_mtok": 3.75, "output_per_mtok": 15.0}


def test_the_ledger_records_the_providers_usage_with_cache_reads(
    keys: None, anthropic_standin: StandIn, gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    ledger = tmp_path / "usage"
    gateway = gateway_factory(
        pools=[anthropic_pool(anthropic_standin.url)],
        policies=policies_doc(models=models(SONNET, **{SONNET: {"price": PRICE}})),
        ledger={"dir": str(ledger), "commit_interval_ms": 20},
    )
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    system = {"type": "text", "text": "You answer briefly. " * 400, "cache_control": {"type": "ephemeral"}}
    messages: list[Any] = [{"role": "system", "content": [system]}, {"role": "user", "content": "hi"}]
    seen, records = [], []
    for _ in range(2):
        answer = client.chat.completions.with_raw_response.create(model=SONNET, messages=messages, max_tokens=8)
        usage = answer.parse().usage
        assert usage is not None
        seen.append(usage)
        found = ledger_records(ledger, answer.headers["x-request-id"])
        assert len(found) == 1  # exactly one record per request
        record = found[0]
        assert record["input_tokens"] == usage.prompt_tokens and record["output_tokens"] == usage.completion_tokens
        details = usage.prompt_tokens_details
        assert record["cached_input_tokens"] == (details.cached_tokens if details else 0)
        records.append(record)
    first, second = seen
    assert first.prompt_tokens == second.prompt_tokens > 1024
    cached = second.prompt_tokens_details.cached_tokens if second.prompt_tokens_details else None
    assert cached is not None and cached > 0  # the second call read the prefix back from the cache
    # the first call wrote the prefix (the cache-write price), the second read it (the cache price)
    wrote, read = records
    written = wrote["cache_write_input_tokens"]
    assert written > 1024 and wrote["cached_input_tokens"] == 0
    m = 1e-6
    plain = wrote["input_tokens"] - written
    assert wrote["cost_usd"] == pytest.approx((plain * 3.0 + written * 3.75 + wrote["output_tokens"] * 15.0) * m)
    assert wrote["cache_saved_usd"] == pytest.approx(-written * 0.75 * m)
    plain = read["input_tokens"] - cached
    assert read["cost_usd"] == pytest.approx((plain * 3.0 + cached * 0.30 + read["output_tokens"] * 15.0) * m)
    assert read["cache_saved_usd"] == pytest.approx(cached * 2.70 * m)


def test_responses_reach_gemini_and_chat_tools_reach_azure(
    keys: None, monkeypatch: pytest.MonkeyPatch, gateway_factory: Callable[..., Gateway]
) -> None:
    monkeypatch.setenv("TW_GEMINI_KEY", "test-key")
    monkeypatch.setenv("TW_AZURE_KEY", "test-key")
    with standin("gemini") as gemini, standin("azure") as azure:
        pools = [
            {"name": "gemini", "model": "gemini-2.5-flash", "engine": "gemini", "api_key_env": "TW_GEMINI_KEY",
             "endpoints": [{"url": gemini.url}]},
            {"name": "azure", "model": "gpt-4.1-mini", "engine": "azure-openai", "api_key_env": "TW_AZURE_KEY",
             "served_model_name": "gpt-41-mini", "api_version": "2024-10-21", "endpoints": [{"url": azure.url}]},
        ]  # fmt: skip
        gateway = gateway_factory(pools=pools, policies=policies_doc(models=models("gemini-2.5-flash", "gpt-4.1-mini")))
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
        response = client.responses.create(model="gemini-2.5-flash", input="hi", max_output_tokens=256)
        assert response.model == "gemini-2.5-flash" and response.output_text and response.status == "completed"
        assert response.usage is not None and response.usage.output_tokens > 0
        events = list(client.responses.create(model="gemini-2.5-flash", input="hi", max_output_tokens=256, stream=True))
        assert events[-1].type == "response.completed"
        tool: Any = {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
        answer = client.chat.completions.create(
            model="gpt-4.1-mini",
            messages=HI,
            max_tokens=16,
            tools=[tool],
            tool_choice="required",
        )
        assert answer.model == "gpt-4.1-mini"
        calls: Any = answer.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "weather"


def test_a_provider_error_mid_stream_ends_the_clients_stream_as_an_engine_failure_does(
    keys: None, gateway_factory: Callable[..., Gateway]
) -> None:
    with standin("anthropic", "--fail-after-tokens", "3") as failing:
        gateway = gateway_factory(pools=[anthropic_pool(failing.url)], policies=policies_doc(models=models(SONNET)))
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
        received: list[Any] = []
        with pytest.raises(openai.APIError) as cut:
            received.extend(client.chat.completions.create(model=SONNET, messages=HI, max_tokens=32, stream=True))
        # the stream ends in an error event, never a clean finish (what reached the client before it
        # depends on how the provider's bytes were split: a read holding text and the error loses both)
        assert not any(c.choices and c.choices[0].finish_reason for c in received)
        assert cut.value.message


def test_a_saturated_owned_pool_spills_to_the_hosted_overflow_pool_and_requests_come_back(
    keys: None, anthropic_standin: StandIn, gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    """One simulated replica with one slot (slowed down 20x) and the Anthropic stand-in as overflow:
    a request arriving while the slot is busy waits past `spill.max_wait_ms` and goes to the hosted
    pool; once the slot is free, the next one is served at home."""
    owned = {
        "name": "owned", "model": SONNET, "engine": "sim", "preset": "llama-3.1-8b@h100", "replicas": 1,
        "devices": [0], "max_num_seqs": 1, "ready_timeout_s": 90, "extra_args": ["--time-scale", "0.05"],
    }  # fmt: skip
    ports = {name: free_port() for name in ("port_base", "kv_events_port_base", "kv_events_replay_port_base")}
    backends = {"devices": [0], "log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports}
    gateway = gateway_factory(
        pools=[owned, anthropic_pool(anthropic_standin.url, overflow=True)],
        policies=policies_doc(models=models(SONNET), spill={"max_wait_ms": 100}),
        backends=backends,
        flow_control={"saturation": {"max_engine_waiting": 0}},
    )
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=120)

    def served_by(max_tokens: int) -> str:
        answer = client.chat.completions.with_raw_response.create(model=SONNET, messages=HI, max_tokens=max_tokens)
        assert answer.parse().choices[0].message.content
        return answer.headers["x-tokenway-endpoint"].split("/")[0]

    assert served_by(4) == "owned"
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(served_by, 64)  # holds the one slot for seconds
        time.sleep(0.5)  # let it take the slot first (it is dispatched at once: the pool is idle)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not busy.done():
            if served_by(4) == "claude":  # arrived while the slot was busy: spilled
                break
        else:
            pytest.fail("no request spilled while the owned pool was full")
        assert busy.result() == "owned"
    assert served_by(4) == "owned"  # capacity is back: the next request stays home


def test_a_provider_that_announced_its_limit_is_not_sent_to_until_its_reset(
    keys: None, bedrock_standin: StandIn, gateway_factory: Callable[..., Gateway]
) -> None:
    """The provider's headers said no requests remain: the next request goes straight to the fallback
    model without a round trip to the provider (it sees no refused call); a 429 it sends blocks it too."""
    chain = {SONNET: {"fallbacks": [{"model": HAIKU, "triggers": ["rate_limited", "upstream_error"]}]}}
    with standin("anthropic", "--rpm", "2") as limited:
        gateway = gateway_factory(
            pools=[anthropic_pool(limited.url), bedrock_pool(bedrock_standin.url)],
            policies=policies_doc(models=models(SONNET, HAIKU, **chain)),
        )
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
        served = [client.chat.completions.create(model=SONNET, messages=HI, max_tokens=8).model for _ in range(4)]
        assert served == [SONNET, SONNET, HAIKU, HAIKU], served
        usage: Any = limited.usage()
        assert sum(m["refused"] for m in usage["models"].values()) == 0, usage  # never sent into its announced limit
        assert sum(m["requests"] for m in usage["models"].values()) == 2, usage
        status = gateway_status(gateway)
        assert status["claude/both-s0"]["blocked_s"] > 0 and status["claude/both-s0"]["blocks"] >= 1


def gateway_status(gateway: Gateway) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(gateway.url + "/admin/pools", timeout=10).json().get("provider_quotas", {})
    return found


@pytest.mark.parametrize("policy", ["off", "auto"])
def test_cache_breakpoints_by_policy_turn_an_unmarked_agent_loop_into_cache_reads(
    keys: None, anthropic_standin: StandIn, gateway_factory: Callable[..., Gateway], policy: str
) -> None:
    """An OpenAI-style client marks nothing: with `cache_breakpoints: auto` its second turn reads the
    system prompt and the first turn back from Anthropic's cache (billed at the cache price); off, nothing."""
    gateway = gateway_factory(
        pools=[anthropic_pool(anthropic_standin.url, cache_breakpoints=policy)],
        policies=policies_doc(models=models(SONNET, **{SONNET: {"price": PRICE}})),
    )
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": "You answer briefly. " * 400},
        {"role": "user", "content": "hi"},
    ]
    first = client.chat.completions.create(model=SONNET, messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    second = client.chat.completions.create(model=SONNET, messages=messages, max_tokens=8)
    details = second.usage.prompt_tokens_details if second.usage is not None else None
    cached = details.cached_tokens if details is not None and details.cached_tokens else 0
    if policy == "auto":
        assert cached > 1024  # the system prompt and the first turn, read back
    else:
        assert cached == 0


def test_a_pool_of_several_provider_keys_is_balanced_and_each_keys_limit_kept(
    keys: None, bedrock_standin: StandIn, gateway_factory: Callable[..., Gateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Anthropic accounts (each its own key, each `--rpm 2`) in one pool: four requests are served by
    Sonnet across both, no account is sent into its announced limit, and the fifth falls back to Haiku."""
    monkeypatch.setenv("TW_KEY_A", "key-a")
    monkeypatch.setenv("TW_KEY_B", "key-b")
    chain = {SONNET: {"fallbacks": [{"model": HAIKU, "triggers": ["rate_limited", "upstream_error"]}]}}
    with (
        standin("anthropic", "--rpm", "2", "--api-key", "key-a") as a,
        standin("anthropic", "--rpm", "2", "--api-key", "key-b") as b,
    ):
        pool = anthropic_pool(a.url)
        pool.pop("api_key_env")
        pool["endpoints"] = [{"url": a.url, "api_key_env": "TW_KEY_A"}, {"url": b.url, "api_key_env": "TW_KEY_B"}]
        gateway = gateway_factory(
            pools=[pool, bedrock_pool(bedrock_standin.url)],
            policies=policies_doc(models=models(SONNET, HAIKU, **chain)),
        )
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
        served = [client.chat.completions.create(model=SONNET, messages=HI, max_tokens=8).model for _ in range(5)]
        assert served == [SONNET] * 4 + [HAIKU], served
        for account in (a, b):
            usage: Any = account.usage()
            assert sum(m["requests"] for m in usage["models"].values()) == 2, usage  # each key took its share
            assert sum(m["refused"] for m in usage["models"].values()) == 0, usage


def test_two_pools_of_one_model_bill_each_at_its_own_price(
    keys: None, gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    """One model on two Anthropic pools, the second dearer (`pool_prices`): the first takes requests
    until its provider says none remain (`--rpm 2`), then the second serves; the ledger prices every
    request at the pool that served it, and the key's daily budget is charged the same figures."""
    ledger = tmp_path / "usage"
    dear = {"input_per_mtok": 6.0, "output_per_mtok": 30.0}
    with standin("anthropic", "--rpm", "2") as cheap_api, standin("anthropic") as dear_api:
        gateway = gateway_factory(
            pools=[anthropic_pool(cheap_api.url, name="cheap"), anthropic_pool(dear_api.url, name="dear")],
            policies=policies_doc(
                models=models(SONNET, **{SONNET: {"price": PRICE, "pool_prices": {"dear": dear}}}),
                budgets=[{"scope": "key", "usd_per_day": 5.0}],
            ),
            ledger={"dir": str(ledger), "commit_interval_ms": 20},
        )
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
        records = []
        for _ in range(4):
            answer = client.chat.completions.with_raw_response.create(model=SONNET, messages=HI, max_tokens=8)
            (record,) = ledger_records(ledger, answer.headers["x-request-id"])
            records.append(record)
    assert [r["pool"] for r in records] == ["cheap", "cheap", "dear", "dear"]
    m = 1e-6
    for record in records:
        rates = (3.0, 15.0) if record["pool"] == "cheap" else (6.0, 30.0)
        expected = (record["input_tokens"] * rates[0] + record["output_tokens"] * rates[1]) * m
        assert record["cost_usd"] == pytest.approx(expected), record
    key = httpx.get(f"{gateway.base_url}/key", headers={"authorization": f"Bearer {TEST_KEY}"}).json()
    assert key["data"]["spend_usd"]["day"] == pytest.approx(sum(r["cost_usd"] for r in records), rel=1e-6), key

"""What a client reads when its model and the fallbacks are refused, and what an OpenAI-compatible
pool was not sent: real gateway processes, simulated engines, the official openai client."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.procs import OTHER_KEY, TEST_KEY, Gateway, SimEngines, policies_doc, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LLAMA, QWEN = "llama-3.1-8b", "qwen2.5-7b"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def test_a_chain_that_runs_out_names_the_model_asked_for_and_claims_no_fallback(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    llama = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    qwen = sim_factory(count=1, time_scale=50, preset="qwen2.5-7b@h100", served_model_name=QWEN)
    policy = policies_doc(
        models={LLAMA: {"fallbacks": [{"model": QWEN, "triggers": ["rate_limited"]}]}, QWEN: {}},
        limits=[{"scope": "key_model", "rpm": 1}],  # one request a minute per key and model
    )
    gateway = gateway_factory(
        pools=[static_pool("llama", LLAMA, llama.urls), static_pool("qwen", QWEN, qwen.urls)], policies=policy
    )
    client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
    first = client.chat.completions.with_raw_response.create(model=LLAMA, messages=HI, max_tokens=4)
    assert first.parse().model == LLAMA and "x-tokenway-fallback" not in first.headers
    second = client.chat.completions.with_raw_response.create(model=LLAMA, messages=HI, max_tokens=4)
    assert second.parse().model == QWEN
    assert second.headers["x-tokenway-fallback"] == f"{LLAMA}->{QWEN};reason=rate_limited"
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=LLAMA, messages=HI, max_tokens=4)
    message = refused.value.message
    assert f"Rate limit reached for {LLAMA}" in message and f"The fallback to {QWEN} was refused too" in message
    assert "x-tokenway-fallback" not in refused.value.response.headers  # nothing served: no fallback claimed
    assert float(refused.value.response.headers["retry-after"]) > 0


def test_fields_a_remote_openai_pool_is_not_sent_are_named_on_debug(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    hosted = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    pool = static_pool("hosted", LLAMA, hosted.urls, engine="openai", extra_request_fields=["top_k"])
    gateway = gateway_factory(pools=[pool], policies=policies_doc())
    client = openai.OpenAI(base_url=gateway.base_url, api_key=OTHER_KEY, max_retries=0)
    extra = {"top_k": 5, "guided_json": {"type": "object"}, "repetition_penalty": 1.1}
    answer = client.chat.completions.with_raw_response.create(
        model=LLAMA, messages=HI, max_tokens=4, extra_body=extra, extra_headers={"x-tokenway-debug": "1"}
    )
    assert answer.parse().choices
    assert answer.headers["x-tokenway-dropped-fields"] == "guided_json,repetition_penalty"  # top_k went through
    quiet = client.chat.completions.with_raw_response.create(model=LLAMA, messages=HI, max_tokens=4, extra_body=extra)
    assert "x-tokenway-dropped-fields" not in quiet.headers  # only when asked for


def test_engine_control_fields_the_policy_drops_are_named_on_debug_and_the_gateways_own_are_not(
    sim_factory: Callable[..., SimEngines], gateway_factory: Callable[..., Gateway]
) -> None:
    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    gateway = gateway_factory(pools=[static_pool("local", LLAMA, engines.urls)], policies=policies_doc())
    client = openai.OpenAI(base_url=gateway.base_url, api_key=OTHER_KEY, max_retries=0)
    answer = client.chat.completions.with_raw_response.create(
        model=LLAMA,
        messages=HI,
        max_tokens=4,
        extra_body={"cache_salt": "mine", "top_k": 5},  # vLLM takes top_k; cache_salt is the policy's
        extra_headers={"x-tokenway-debug": "1"},
    )
    assert answer.parse().choices
    assert answer.headers["x-tokenway-dropped-fields"] == "cache_salt"  # not priority, which tokenway set

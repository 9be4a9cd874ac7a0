"""A hosted pool's first-token deadline (`first_token_timeout_s`, issue 41), end to end: a real
`tokenway serve` in front of provider stand-ins (`python -m sim.hosted --ttft-ms/--tpot-ms`). A stream
that has shown its client nothing by the deadline moves on (here: down the fallback chain); one that
already answered is never cut, however slow its later tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from backends.config import PoolConfig
from tests.e2e.test_hosted_pools import HAIKU, HI, SONNET, anthropic_pool, bedrock_pool, models
from tests.sim.hosted.standin import standin
from tests.support.procs import TEST_KEY, Gateway, policies_doc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CHAIN = {SONNET: {"fallbacks": [{"model": HAIKU, "triggers": ["upstream_error"]}]}}


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TW_ANTHROPIC_KEY", "test-key")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-key")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def streamed(client: openai.OpenAI, **extra: Any) -> tuple[str, str, list[Any]]:
    """The stream's model, its text and its chunks (the fallback header read from the raw answer)."""
    raw = client.chat.completions.with_raw_response.create(
        model=SONNET, messages=HI, max_tokens=6, stream=True, **extra
    )
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return raw.headers.get("x-tokenway-fallback", ""), text, chunks


def test_a_provider_slow_to_its_first_token_is_cut_and_the_stream_falls_back(
    gateway_factory: Callable[..., Gateway],
) -> None:
    with standin("anthropic", "--ttft-ms", "20000") as slow, standin("bedrock") as fast:
        gateway = gateway_factory(
            pools=[anthropic_pool(slow.url, first_token_timeout_s=0.5), bedrock_pool(fast.url)],
            policies=policies_doc(models=models(SONNET, HAIKU, **CHAIN)),
        )
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
        fallback, text, chunks = streamed(client)
        assert fallback.startswith(f"{SONNET}->{HAIKU}")
        assert text and all(c.model == HAIKU for c in chunks)
        assert chunks[-1].choices[0].finish_reason is not None


def test_a_stream_already_answering_is_never_cut_by_the_deadline(gateway_factory: Callable[..., Gateway]) -> None:
    # the first token comes at once, the next ones each take longer than the whole deadline
    with standin("anthropic", "--tpot-ms", "700") as steady, standin("bedrock") as fast:
        gateway = gateway_factory(
            pools=[anthropic_pool(steady.url, first_token_timeout_s=0.5), bedrock_pool(fast.url)],
            policies=policies_doc(models=models(SONNET, HAIKU, **CHAIN)),
        )
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
        fallback, text, chunks = streamed(client, stream_options={"include_usage": True})
        assert not fallback
        assert text and all(c.model == SONNET for c in chunks)
        finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finished and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 1


def test_the_deadline_is_a_hosted_pools_setting() -> None:
    with pytest.raises(ValueError, match="first_token_timeout_s"):
        PoolConfig(name="engines", model="m", engine="sim", replicas=1, first_token_timeout_s=1.0)

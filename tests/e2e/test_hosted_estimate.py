"""A hosted pool's prompt count is the labelled estimate, and its error against what the provider
billed is measured per model in `/admin/backends` (docs/providers.md, "Prompt tokens before the
answer"): a real `tokenway serve` in front of the Anthropic stand-in."""

from __future__ import annotations

import json
from collections.abc import Callable

import openai
import pytest

from tests.sim.hosted.standin import standin
from tests.support.procs import TEST_KEY, Gateway, http_get, policies_doc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SONNET = "claude-sonnet-4-5"


def test_the_estimate_is_labelled_and_its_ratio_to_the_billed_count_shown(
    monkeypatch: pytest.MonkeyPatch, gateway_factory: Callable[..., Gateway]
) -> None:
    monkeypatch.setenv("TW_ANTHROPIC_KEY", "test-key")
    with standin("anthropic") as provider:
        pool = {
            "name": "claude",
            "model": SONNET,
            "engine": "anthropic",
            "served_model_name": "claude-sonnet-4-5-20250929",
            "api_key_env": "TW_ANTHROPIC_KEY",
            "endpoints": [{"url": provider.url}],
        }
        gateway = gateway_factory(pools=[pool], policies=policies_doc(models={SONNET: {}}))
        client = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0)
        texts = ("hi", "Summarise the plot of a long novel about a lighthouse keeper in three sentences, please.")
        billed = [
            client.chat.completions.create(
                model=SONNET, messages=[{"role": "user", "content": text}], max_tokens=8
            ).usage.prompt_tokens  # type: ignore[union-attr]
            for text in texts
        ]
        status, text = http_get(gateway.url + "/admin/backends", timeout_s=10)
    assert status == 200, text
    tokenizer = next(p for p in json.loads(text)["pools"] if p["name"] == "claude")["tokenizer"]
    assert tokenizer["source"] == "estimate" and tokenizer["exact"] is False
    audit = tokenizer["audit"]
    assert audit["requests"] == 2 and audit["reported_tokens"] == sum(billed) > 0
    assert audit["ratio"] == round(audit["counted_tokens"] / sum(billed), 4)
    assert audit["ratio_min"] <= audit["ratio"] <= audit["ratio_max"]

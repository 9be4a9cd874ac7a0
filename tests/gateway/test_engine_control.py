"""The engine body the gateway writes: the output limit from the reservation, the cache salt its own,
`min_tokens` never above the limit."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.upstream.relay import check_min_tokens, engine_body
from policies.policy import cache_salt
from policies.types import Principal

PRINCIPAL = Principal(key_id="k1", tenant="t1", allowed_models=None, priority=0)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def shaped(body: dict[str, Any], api: str, reserved: int, **extra: Any) -> dict[str, Any]:
    return engine_body(body, PRINCIPAL, (), api=api, reserved_output_tokens=reserved, **extra)


@pytest.mark.parametrize(
    ("api", "body", "field"),
    [
        ("chat", CHAT, "max_tokens"),
        ("completions", {"model": "m", "prompt": "hi"}, "max_tokens"),
        ("responses", {"model": "m", "input": "hi"}, "max_output_tokens"),
    ],
)
def test_without_a_client_limit_the_engine_is_told_the_reservation(api: str, body: dict[str, Any], field: str) -> None:
    out = shaped(body, api, 300)
    assert out[field] == 300 and field not in body  # the client's body is not changed


def test_a_client_limit_within_the_reservation_is_kept_and_a_larger_one_lowered() -> None:
    assert shaped({**CHAT, "max_tokens": 50}, "chat", 300)["max_tokens"] == 50
    assert shaped({**CHAT, "max_tokens": 500}, "chat", 300)["max_tokens"] == 300
    out = shaped({**CHAT, "max_completion_tokens": 500}, "chat", 300)
    assert out["max_completion_tokens"] == 300 and "max_tokens" not in out
    assert shaped({"model": "m", "max_tokens": 4096}, "messages", 1024)["max_tokens"] == 1024


def test_choices_share_the_reservation() -> None:
    assert shaped({**CHAT, "n": 4}, "chat", 400)["max_tokens"] == 100


def test_an_added_limit_stays_within_the_context_left() -> None:
    assert shaped(CHAT, "chat", 1024, context_room=100)["max_tokens"] == 100
    assert shaped({**CHAT, "max_tokens": 500}, "chat", 1024, context_room=100)["max_tokens"] == 500  # the client's


def test_nothing_is_capped_for_an_api_that_generates_nothing() -> None:
    assert "max_tokens" not in shaped({"model": "m", "input": "x"}, "embeddings", 0)


def test_the_cache_salt_is_only_ever_the_gateways() -> None:
    salt = cache_salt("tenant:t1")
    assert shaped({**CHAT, "cache_salt": "mine"}, "chat", 10, cache_salt=salt)["cache_salt"] == salt
    trusted = engine_body({**CHAT, "cache_salt": "mine"}, PRINCIPAL, ("cache_salt",))
    assert "cache_salt" not in trusted  # without the gateway's salt, not the client's either


@pytest.mark.parametrize(
    ("body", "max_tokens"), [({"min_tokens": 6}, 5), ({"min_tokens": -1}, None), ({"min_tokens": "3"}, 9)]
)
def test_min_tokens_above_the_limit_or_malformed_is_refused(body: dict[str, Any], max_tokens: int | None) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_min_tokens(body, max_tokens)
    assert refused.value.param == "min_tokens"


@pytest.mark.parametrize(("body", "max_tokens"), [({}, 5), ({"min_tokens": 5}, 5), ({"min_tokens": 900}, None)])
def test_min_tokens_within_the_limit_passes(body: dict[str, Any], max_tokens: int | None) -> None:
    check_min_tokens(body, max_tokens)

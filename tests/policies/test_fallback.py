"""Fallback chains and the context-length check (pure functions)."""

from __future__ import annotations

from typing import Any

import pytest

from policies.policy import Policy, check_context, choose_fallback, hash_key
from policies.schema import PoliciesConfig

ALL = ["rate_limited", "budget_exhausted", "upstream_error", "context_too_long", "slo_unattainable"]


def chain_policy() -> Policy:
    doc: dict[str, Any] = {
        "tenants": {"open": {}, "closed": {"allow_fallback": False}, "narrow": {"models": ["a", "c"]}},
        "keys": [
            {"id": "o", "tenant": "open", "sha256": hash_key("o")},
            {"id": "x", "tenant": "closed", "sha256": hash_key("x")},
            {"id": "n", "tenant": "narrow", "sha256": hash_key("n")},
        ],
        "models": {
            "a": {
                "context_length": 4096,
                "fallbacks": [
                    {"model": "b", "triggers": ["rate_limited", "budget_exhausted"]},
                    {"model": "long", "triggers": ["context_too_long"]},
                ],
            },
            "b": {"context_length": 4096, "fallbacks": [{"model": "c-alias", "triggers": ALL}]},
            "c": {"aliases": ["c-alias"], "context_length": 8192},
            "long": {"context_length": 131072},
        },
    }
    return Policy(PoliciesConfig.model_validate(doc))


def who(p: Policy, key: str) -> Any:
    principal = p.authenticate(key)
    assert principal is not None
    return principal


@pytest.mark.parametrize(
    ("key", "model", "trigger", "opt_out", "tried", "expected"),
    [
        ("o", "a", "rate_limited", False, (), "b"),
        ("o", "a", "upstream_error", False, (), None),  # a -> b is not for this trigger, nor what follows b
        ("o", "a", "rate_limited", False, ("b",), "c"),  # b tried: its own chain follows
        ("o", "b", "rate_limited", False, (), "c"),  # aliases resolved
        ("o", "c", "rate_limited", False, (), None),  # end of the chain
        ("o", "a", "rate_limited", True, (), None),  # the request opted out
        ("x", "a", "rate_limited", False, (), None),  # the tenant does not allow fallbacks
        ("n", "a", "rate_limited", False, (), "c"),  # b is not allowed for this key: skipped
        ("o", "b", "slo_unattainable", False, (), "c"),
    ],
    ids=["first", "trigger-gates", "tried", "alias", "end", "opt-out", "tenant-off", "not-allowed", "slo"],
)
def test_choose_fallback(
    key: str, model: str, trigger: str, opt_out: bool, tried: tuple[str, ...], expected: str | None
) -> None:
    p = chain_policy()
    assert choose_fallback(p, model, trigger, who(p, key), opt_out, tried=tried) == expected


def test_context_too_long_picks_a_model_that_fits() -> None:
    p = chain_policy()
    assert choose_fallback(p, "a", "context_too_long", who(p, "o"), min_context_tokens=6000) == "long"
    assert choose_fallback(p, "a", "context_too_long", who(p, "o"), min_context_tokens=200_000) is None


def test_check_context() -> None:
    p = chain_policy()
    assert check_context(p, "a", 3000, 1096) is None
    assert check_context(p, "unknown", 10**6, None) is None
    rejection = check_context(p, "a", 3000, 2000)
    assert rejection is not None
    assert (rejection.status, rejection.type, rejection.code, rejection.param, rejection.reason) == (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
        "context_too_long",
    )
    assert "maximum context length is 4096 tokens" in rejection.message
    assert "5000 tokens (3000 in the messages, 2000 in the completion)" in rejection.message
    assert check_context(p, "a", 4096, None) is not None  # no room left for a single token

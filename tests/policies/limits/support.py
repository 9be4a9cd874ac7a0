"""Small builders for admission tests: a policy from a dict, request facts, a store of each kind."""

from __future__ import annotations

from typing import Any

from policies.policy import Policy, hash_key
from policies.schema import PoliciesConfig
from policies.types import Principal, RequestFacts

KEY = "sk-test-key-1"
OTHER_KEY = "sk-test-key-2"


def policy(**sections: Any) -> Policy:
    """Tenants t1 (keys k1, k2) and t2 (k3); models big (priced) and small (cheaper); plus `sections`."""
    doc: dict[str, Any] = {
        "tenants": {"t1": {}, "t2": {"allow_fallback": False}},
        "keys": [
            {"id": "k1", "tenant": "t1", "sha256": hash_key(KEY)},
            {"id": "k2", "tenant": "t1", "sha256": hash_key(OTHER_KEY)},
            {"id": "k3", "tenant": "t2", "sha256": hash_key("sk-test-key-3")},
        ],
        "models": {
            "big": {
                "aliases": ["gpt-big"],
                "context_length": 8192,
                "default_max_tokens": 512,
                "price": {"input_per_mtok": 10.0, "cached_input_per_mtok": 1.0, "output_per_mtok": 30.0},
                "fallbacks": [{"model": "small", "triggers": ["rate_limited", "budget_exhausted"]}],
            },
            "small": {
                "context_length": 32768,
                "default_max_tokens": 256,
                "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
            },
        },
    }
    doc.update(sections)
    return Policy(PoliciesConfig.model_validate(doc))


def principal(p: Policy, key: str = KEY) -> Principal:
    found = p.authenticate(key)
    assert found is not None
    return found


def facts(
    who: Principal,
    *,
    prompt_tokens: int = 100,
    max_tokens: int | None = 1000,
    model: str = "big",
    api: str = "chat",
    n: int = 1,
) -> RequestFacts:
    output = 0 if api == "embeddings" else (max_tokens if max_tokens is not None else 512) * n
    return RequestFacts(
        request_id="req-1",
        api=api,  # type: ignore[arg-type]
        body={"n": n} if n != 1 else {},
        requested_model=model,
        model=model,
        principal=who,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        output_reservation=output,
    )


def header(headers: tuple[tuple[str, str], ...], name: str) -> str | None:
    for key, value in headers:
        if key == name:
            return value
    return None

"""Plain-value builders for routing tests: endpoints, pools and request facts, no clock, no server."""

from __future__ import annotations

from typing import Any

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Pool
from backends.types import Endpoint, EndpointState, EndpointStats, InFlight, Role
from policies.routing.prefix_blocks import HashedPrompt
from policies.routing.types import Candidate, RouteContext, RouteRequest
from policies.slo import Slo
from policies.types import Principal, RequestFacts

NOW_S = 1000.0
PRINCIPAL = Principal(key_id="k", tenant="t", allowed_models=None, priority=0)


def token_ids(n: int, start: int = 0) -> list[int]:
    """n deterministic, distinct-looking token ids; different `start` -> a different sequence."""
    return [(start * 1_000_003 + i * 7919) % 100_000 for i in range(n)]


def endpoint(
    endpoint_id: str,
    *,
    pool: str = "p",
    role: Role = Role.BOTH,
    engine: str = "sim",
    waiting: int = 0,
    running: int = 0,
    kv_usage_ratio: float = 0.0,
    prefill_tokens: int = 0,
    decode_tokens: int = 0,
    requests: int = 0,
    scraped_at_s: float = NOW_S,
    block_size: int | None = 16,
    num_gpu_blocks: int | None = None,
    max_model_len: int | None = None,
    state: EndpointState = EndpointState.READY,
) -> Endpoint:
    return Endpoint(
        id=endpoint_id,
        pool=pool,
        base_url=f"http://{endpoint_id}",
        engine=engine,
        served_model="m",
        role=role,
        state=state,
        max_model_len=max_model_len,
        stats=EndpointStats(
            running=running,
            waiting=waiting,
            kv_usage_ratio=kv_usage_ratio,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            scraped_at_s=scraped_at_s,
        ),
        inflight=InFlight(requests=requests, prefill_tokens=prefill_tokens, decode_tokens=decode_tokens),
    )


def endpoints(n: int, **kwargs: Any) -> list[Endpoint]:
    return [endpoint(f"e{i}", **kwargs) for i in range(n)]


def pool(eps: list[Endpoint], name: str = "p") -> Pool:
    config = PoolConfig(name=name, model="m", endpoints=[StaticEndpointConfig(url=f"http://{e.id}") for e in eps])
    return Pool(config, endpoints=list(eps))


def facts(
    ids: list[int] | None = None,
    *,
    body: dict[str, Any] | None = None,
    model: str = "m",
    session_key: str | None = None,
    cache_salt: str | None = None,
    user: str | None = None,
    max_tokens: int | None = None,
    debug: bool = False,
    request_id: str = "r",
    slo: Slo | None = None,
) -> RequestFacts:
    payload: dict[str, Any] = dict(body or {"model": model, "messages": [{"role": "user", "content": "hi"}]})
    if user is not None:
        payload["user"] = user
    return RequestFacts(
        request_id=request_id,
        api="chat",
        body=payload,
        requested_model=model,
        model=model,
        principal=PRINCIPAL,
        prompt_tokens=len(ids) if ids is not None else 0,
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        session_key=session_key,
        cache_salt=cache_salt,
        debug=debug,
        slo=slo,
    )


def request(ids: list[int] | None = None, **kwargs: Any) -> RouteRequest:
    """What a router reads: `facts(...)` and a fresh hash memo."""
    return RouteRequest(facts(ids, **kwargs))


def prompt(ids: list[int] | None = None, **kwargs: Any) -> HashedPrompt:
    """What a prefix index reads: `facts(...)` and a fresh hash memo."""
    return HashedPrompt(facts(ids, **kwargs))


def candidate(e: Endpoint, cached_tokens: int = 0, saturated: bool = False) -> Candidate:
    return Candidate(e, cached_tokens, saturated)


def context(prompt_tokens: int = 1000, *, session_endpoint_id: str | None = None, **facts_kw: Any) -> RouteContext:
    return RouteContext(
        facts=facts(**facts_kw), now_s=NOW_S, prompt_tokens=prompt_tokens, session_endpoint_id=session_endpoint_id
    )

"""Load of one endpoint in token units, from the gateway's own in-flight accounting.

The gateway's counters are exact and instant (updated at dispatch, first token and completion),
unlike scraped engine metrics, so token-level load signals are built on them.
"""

from __future__ import annotations

from backends.types import Endpoint


def work_tokens(endpoint: Endpoint, decode_weight: float, request_tokens: float = 0.0) -> float:
    """Pending work in prefill-token equivalents.

    `prefill_tokens` (uncached prompt tokens not yet prefilled) count 1 each: a chunked-prefill engine
    must compute them before a newcomer's own prefill finishes. Decode context counts `decode_weight`
    each (it slows every step by reading KV, and it occupies KV). `request_tokens` per in-flight
    request covers requests whose decode load is not yet known (still prefilling).
    """
    inflight = endpoint.inflight
    return inflight.prefill_tokens + decode_weight * inflight.decode_tokens + request_tokens * inflight.requests

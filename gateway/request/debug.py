"""Who gets the debug headers (`x-tokenway-debug`): operators only.

The debug answer names every replica's routing scores, the prefix-cache hit the router expected
(`x-tokenway-route`), the predictor's numbers and the fields that did not reach the engine. The
expected hit alone is a side channel: a tenant resending another's prompt would read from the
router's estimate what the prefix caches hold. So the headers are answered to the operator only:

- with `server.admin_token` set, the request must carry it in `x-tokenway-admin-token` (the
  `Authorization` header holds the API key), compared in constant time;
- without one (a loopback-only gateway, where `/admin/*` trusts direct local callers), to a caller
  straight from a loopback address and not through a reverse proxy (no `Forwarded`,
  `X-Forwarded-For`, `X-Forwarded-Host`, `X-Real-IP`), the same trust as the admin API's; a
  caller whose address the gateway does not see (the endpoint picker's, behind Envoy) needs the
  token.

Anyone else asking for them is served as if they had not asked.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from typing import TYPE_CHECKING

from policies.routing.types import RouteDecision
from predictor.types import Prediction

if TYPE_CHECKING:
    from gateway.request.context import RequestContext

DEBUG_HEADER = "x-tokenway-debug"
ADMIN_TOKEN_HEADER = "x-tokenway-admin-token"
_PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Real-IP")


def _loopback(remote: str | None) -> bool:
    if not remote:  # unknown: the endpoint picker's requests (Envoy holds the client), a unix socket
        return False
    try:
        return ipaddress.ip_address(remote.strip("[]")).is_loopback
    except ValueError:
        return False


def debug_allowed(headers: Mapping[str, str], remote: str | None, admin_token: str | None) -> bool:
    """Whether this request asked for the debug headers and may have them (see the module doc)."""
    if headers.get(DEBUG_HEADER) != "1":
        return False
    if admin_token:
        given = headers.get(ADMIN_TOKEN_HEADER, "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, admin_token.encode("utf-8"))
    return _loopback(remote) and not any(name in headers for name in _PROXY_HEADERS)


def debug_headers(ctx: RequestContext, decision: RouteDecision) -> list[tuple[str, str]]:
    """The debug headers of an answer (`ctx.facts.debug`: asked for and allowed): the routing scores
    (`x-tokenway-route`), the fields that did not reach the engine, the prompt count and its source,
    and what the predictor expected of the serving endpoint."""
    headers = [("x-tokenway-route", decision.debug_header())]
    if ctx.unforwarded_fields:
        headers.append(("x-tokenway-dropped-fields", ",".join(ctx.unforwarded_fields)))
    source = ctx.facts.prompt_tokens_source
    headers.append(("x-tokenway-prompt-tokens", f"{ctx.facts.prompt_tokens};source={source}"))
    if ctx.prediction is not None:
        headers.append(("x-tokenway-prediction", _prediction_header(ctx.prediction)))
    return headers


def _prediction_header(p: Prediction) -> str:
    """`x-tokenway-prediction`: what the predictor expected of the serving endpoint, in ms."""
    return (
        f"ttft={p.ttft_ms:.2f};ttft_p90={p.ttft_p90_ms:.2f};tpot={p.tpot_ms:.3f};tpot_p90={p.tpot_p90_ms:.3f};"
        f"source={p.source};version={p.model_version}"
    )

"""The engine-control fields of an upstream body: the client's dropped (unless its tenant may set
them, `policies/engine_fields.py`), the gateway's own set.

The priority the engine schedules by is the tenant's tier (`tenants.<t>.priority`, a key's override)
on tokenway's scale; each adapter maps it onto its engine's (vLLM: lower runs first) or drops it
where the pool does not schedule by priority. The `normal` tier is every engine's default (vLLM 0,
TensorRT-LLM 0.5), so it is not written. The PD handshake fields are added later by the adapter,
from the prefill engine's answer, never from the client.

Two more fields are always the gateway's, because what is billed and what is shared depend on them:

- **The output limit.** Admission reserved a number of output tokens for the request; an engine
  left to its own default generates until the context is full (vLLM) or until its own default
  limit, however long a `json_schema` with `minItems` or `min_tokens` makes the answer. So the
  engine is told the reservation: the API's limit field is set to the reservation per choice when
  the client gave none, and lowered to it where the client's is larger (a reservation made on a
  fallback model's terms). The engine can then never produce more than was reserved.
- **The prefix-cache salt** (`cache_salt`, vLLM's): each tenant's requests are salted with a value
  derived from its cache group (`tenants.<t>.cache_group`, else the tenant), so a tenant's prompts
  never hit another tenant's cached blocks and `cached_tokens` says nothing about what others sent
  (`policies/engine_fields.cache_salt`). The prefix index keys its blocks with the same salt
  (`RequestFacts.cache_salt`), so routing hits stay per tenant too.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from gateway.errors import InvalidRequest
from policies.engine_fields import client_body
from policies.types import ApiKind, Principal

NORMAL_PRIORITY = 0  # policies.schema.PRIORITY_VALUES["normal"]

# The output-limit fields each upstream API reads, the one the gateway writes when none is set last
# (chat: `max_tokens`, the one every engine knows; vLLM reads `max_completion_tokens` first when both
# are set, TensorRT-LLM's adapter maps it, so a client's `max_completion_tokens` is lowered in place).
OUTPUT_LIMIT_FIELDS: Mapping[str, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",),
}


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_min_tokens(body: Mapping[str, Any], max_tokens: int | None) -> None:
    """`min_tokens` (vLLM, TensorRT-LLM: generate at least that many) must be a count no larger
    than the request's output limit: a larger one asks for more output than may be produced (and
    than was reserved), so it is refused up front, naming the field, rather than by the engine."""
    if "min_tokens" not in body or body["min_tokens"] is None:
        return
    value = _count(body["min_tokens"])
    if value is None or value < 0:
        raise InvalidRequest("min_tokens: must be an integer >= 0", param="min_tokens")
    if max_tokens is not None and value > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({value}) must not be greater than the output limit ({max_tokens})", param="min_tokens"
        )


def choices(body: Mapping[str, Any]) -> int:
    """The number of choices a body asks for (`n`, 1 when absent or malformed)."""
    n = _count(body.get("n"))
    return n if n is not None and n > 0 else 1


def output_limit(reserved_tokens: int, body: Mapping[str, Any]) -> int:
    """The per-choice output limit that keeps `body`'s answer within `reserved_tokens` (for all of
    its choices); 0 when nothing was reserved (an API that generates nothing)."""
    if reserved_tokens <= 0:
        return 0
    return max(reserved_tokens // choices(body), 1)


def cap_output(body: dict[str, Any], api: ApiKind | str, limit: int, context_room: int | None = None) -> None:
    """Make `body` (the gateway's own copy) ask for at most `limit` output tokens per choice. A limit
    the gateway adds is also kept within `context_room` (the context the endpoint has left after the
    prompt) when known: an engine refuses a prompt + max_tokens beyond its context, where without
    the field it would have stopped at the context's end by itself."""
    fields = OUTPUT_LIMIT_FIELDS.get(api)
    if not fields or limit <= 0:
        return
    present = False
    for name in fields:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):  # _count, inlined: once per request
            present = True
            if value > limit:
                body[name] = limit
    if not present:
        body[fields[-1]] = min(limit, context_room) if context_room is not None and context_room > 0 else limit


def engine_body(
    body: dict[str, Any],
    principal: Principal,
    allowed: Collection[str],
    *,
    api: ApiKind | str | None = None,
    reserved_output_tokens: int = 0,
    context_room: int | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """A copy of `body` for the engine: control fields only from policy, priority from the tier, the
    output limit from the reservation (`api` names the fields) and the cache salt the gateway's."""
    shaped, _ = client_body(body, allowed)
    shaped = dict(shaped) if shaped is body else shaped
    if "priority" not in allowed or "priority" not in shaped:
        if principal.priority == NORMAL_PRIORITY:
            shaped.pop("priority", None)  # the engine's default: nothing to say
        else:
            shaped["priority"] = principal.priority
    if api is not None:
        cap_output(shaped, api, output_limit(reserved_output_tokens, shaped), context_room)
    if cache_salt is not None:
        shaped["cache_salt"] = cache_salt
    else:
        shaped.pop("cache_salt", None)  # only ever the gateway's (a trusted tenant's is folded into it)
    return shaped

"""The engine-control fields of an upstream body: the client's dropped (unless its tenant may set
them, `policies/engine_fields.py`), the gateway's own set.

The priority the engine schedules by is the tenant's tier (`tenants.<t>.priority`, a key's override)
on tokenway's scale; each adapter maps it onto its engine's (vLLM: lower runs first) or drops it
where the pool does not schedule by priority. The `normal` tier is every engine's default (vLLM 0,
TensorRT-LLM 0.5), so it is not written: a body that carried no engine-control fields reaches the
engine as the client sent it (the endpoint picker then needs no body mutation). The PD handshake
fields are added later by the adapter, from the prefill engine's answer, never from the client.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from policies.engine_fields import client_body
from policies.types import Principal

NORMAL_PRIORITY = 0  # policies.schema.PRIORITY_VALUES["normal"]


def engine_body(body: dict[str, Any], principal: Principal, allowed: Collection[str]) -> dict[str, Any]:
    """A copy of `body` for the engine: control fields only from policy, priority from the tier."""
    shaped, _ = client_body(body, allowed)
    shaped = dict(shaped) if shaped is body else shaped
    if "priority" not in allowed or "priority" not in shaped:
        if principal.priority == NORMAL_PRIORITY:
            shaped.pop("priority", None)  # the engine's default: nothing to say
        else:
            shaped["priority"] = principal.priority
    return shaped

"""The engine-control fields of an upstream body: the client's dropped (unless its tenant may set
them, `policies/engine_fields.py`), the gateway's own set.

The priority the engine schedules by is the tenant's tier (`tenants.<t>.priority`, a key's override)
on tokenway's scale; each adapter maps it onto its engine's (vLLM: lower runs first) or drops it
where the pool does not schedule by priority. The PD handshake fields are added later by the
adapter, from the prefill engine's answer, never from the client.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from policies.engine_fields import client_body
from policies.types import Principal


def engine_body(body: dict[str, Any], principal: Principal, allowed: Collection[str]) -> dict[str, Any]:
    """A copy of `body` for the engine: control fields only from policy, priority from the tier."""
    shaped, _ = client_body(body, allowed)
    shaped = dict(shaped) if shaped is body else shaped
    if "priority" not in allowed or "priority" not in shaped:
        shaped["priority"] = principal.priority
    return shaped

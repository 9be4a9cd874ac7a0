"""The gateway's one extension of the usage objects it translates: `cost_usd`.

A caller whose policy shows it the cost (`show_cost`, docs/governance.md) finds the dollars its
request cost in the answer's usage. The gateway writes it into the chat usage it translates from;
each API's usage object carries it over under the same name, and writes nothing otherwise, so the
bodies of every other caller stay exactly the API's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def with_cost(usage: Mapping[str, Any]) -> dict[str, Any]:
    """`{"cost_usd": …}` when the chat usage carries it; nothing otherwise."""
    cost = usage.get("cost_usd")
    return {} if cost is None else {"cost_usd": cost}
